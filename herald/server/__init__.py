"""``herald serve``: an OpenAI-compatible HTTP server over any engine (:mod:`herald.server.api`)."""
