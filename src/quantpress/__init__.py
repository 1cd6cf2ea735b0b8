"""quantpress: an offline quantizer and format converter for large language models.

Layers, bottom to top (a module imports only from its own layer and those below):

- :mod:`quantpress.errors`, :mod:`quantpress.devices`, :mod:`quantpress.memory`,
  :mod:`quantpress.workers`, :mod:`quantpress.assets`: exit-code errors, devices/dtypes and
  batch sizing, glibc's heap, the worker pool, cached downloads;
- :mod:`quantpress.quantize`: codecs, pure tensor math (ggml types, AWQ, GPTQ, EXL2);
- :mod:`quantpress.calibration`: calibration text, the layer-streaming engine, statistics,
  AWQ per layer, EXL2 measurement and bit allocation, perplexity / KL divergence;
- :mod:`quantpress.convert`: containers (HF reader, GGUF, AWQ and EXL2 directories, imatrix
  files, the loader registry);
- :mod:`quantpress.targets`: one declared target per output kind and the runner;
- :mod:`quantpress.cli`: the ``convert`` and ``quantize`` commands (``python -m quantpress``).

:mod:`quantpress.configs` holds data (TOML), read by every layer.
"""
from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("quantpress")
except _metadata.PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0+unknown"
