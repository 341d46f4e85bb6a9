"""The local API server (``tandem serve``): OpenAI and Anthropic dialects on one port.

``server`` (TandemServer, make_server) ties together ``http`` (the HTTP layer), ``routes`` (the
endpoints), ``worker`` (the one engine thread), ``metrics`` (/metrics and /events) and the
dialects ``openai``/``anthropic`` with their shared ``chat_format``."""
