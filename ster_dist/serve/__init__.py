"""`ster serve`: the token engine and the job queue over HTTP (OpenAI's API and Ster's serve
API)."""
