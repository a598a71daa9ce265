"""kiln bench's mock LLM (see ``model.py``); kiln imports only :mod:`.mock_tokens` from here."""
