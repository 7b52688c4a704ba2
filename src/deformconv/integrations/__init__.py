"""deformconv inside other libraries' models: ``integrations.transformers`` (Hugging Face transformers). Each is
imported on its own (``import deformconv.integrations.transformers``); ``import deformconv`` imports none of them, nor
the libraries they serve."""
