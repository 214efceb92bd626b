"""Hugging Face safetensors on object stores: export a DCP checkpoint as safetensors files, and load a
directory of safetensors files with DCP onto any sharding."""

from .export import DEFAULT_MAX_FILE_SIZE, ExportReport, export_safetensors
from .reader import SafetensorsReader

__all__ = ["DEFAULT_MAX_FILE_SIZE", "ExportReport", "SafetensorsReader", "export_safetensors"]
