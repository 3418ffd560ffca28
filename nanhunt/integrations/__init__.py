"""Optional integrations: Lightning and Hugging Face. Each imports its framework only when used."""
