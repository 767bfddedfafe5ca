"""The HTTP frontend: OpenAI-compatible chat completions and SGLang's native `/generate`, on the same
decode workers and store as the gRPC frontend. Stateless clients resend whole conversations; a request
whose history matches a session's continues that session (docs/services.md, HTTP API)."""
