"""Suite-wide set-up: the engine remembers measured GEMM call shapes under HICACHE_CACHE_DIR; the tests
(and the servers and ranks they start, which inherit the environment) use a fresh folder of their
own instead of the user's ~/.cache."""

import os
import tempfile

os.environ.setdefault("HICACHE_CACHE_DIR", tempfile.mkdtemp(prefix="hicache-test-cache-"))
