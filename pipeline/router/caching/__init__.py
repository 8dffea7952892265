"""The router's response cache: its entries, bounded in bytes (`response_cache`), and the policy that decides
which requests are cached, under which versions, and when entries go (`cache_policy`)."""
