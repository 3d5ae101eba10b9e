"""Hugging Face folders in and out: reading a released safetensors folder straight into the sharded model
(`reader`, `storage`, `load`), writing one (`folder`), and exporting one every so many steps during training
(`export`). Each model family's name and layout mapping lives with the family (`models/<family>/hf.py`)."""
