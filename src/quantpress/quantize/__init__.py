"""quantpress codecs: pure tensor math, no file I/O and no model code.

Everything in this package takes torch tensors and returns torch tensors on the same
device. Higher layers (calibration, convert, cli) import from here; never the reverse.
"""
