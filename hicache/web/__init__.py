"""HTTP plumbing the two services share, the OpenAI-compatible server (hicache/server/) and the P/D
router (hicache/router/): OpenAI-style error responses and the handlers every app installs, a request
that ends when its client goes away, and the listening socket. Nothing of either service is here."""
