"""Integrations with optional libraries (PEFT, Hugging Face Trainer, TRL)."""
