"""``herald serve``: an OpenAI-compatible HTTP server over the dense engine (issue 7)."""
