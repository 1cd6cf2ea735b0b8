"""Containers: read Hugging Face directories, write and read GGUF (and later AWQ/EXL2)
on disk, and verify outputs by round trip. Imports quantize/ and calibration/, never cli/."""
