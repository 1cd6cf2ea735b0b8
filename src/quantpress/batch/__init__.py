"""Batch jobs (``quantize batch JOBS.toml -o OUT_ROOT``): many outputs of many models from one
job file, sharing the source's reads and one calibration pass per model, resumable
(:mod:`quantpress.batch.jobfile`, :mod:`quantpress.batch.runner`,
:mod:`quantpress.batch.manifest`)."""
