"""Tool-call parsers (issue 29): one module per format (hermes.py, llama3.py, mistral.py,
deepseek.py) on the shared engine of base.py, registered by name in registry.py; names.py is the
dependency-free table of names a config may give (mindie/config.py reads it). This package
imports nothing itself, so importing ``names`` stays light."""
