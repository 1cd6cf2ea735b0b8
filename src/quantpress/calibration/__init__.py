"""Calibration data and statistics (activation capture, measurement, allocation).
Imports quantize/ only."""
