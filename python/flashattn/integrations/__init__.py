"""Adapters that plug flashattn's attention into other libraries' models.

``flashattn.integrations.transformers``: a Hugging Face transformers attention backend."""
