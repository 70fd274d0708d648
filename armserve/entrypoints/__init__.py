"""Ways in from outside: the OpenAI-compatible HTTP server and its terminal chat client."""
