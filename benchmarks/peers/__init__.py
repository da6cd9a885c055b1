"""Peer inference engines run on the engine's workloads, for ``bench offline``.

Each module (``engine``, ``hf_static``, ``hf_continuous``, ``llama_cpp``) exposes
``available()`` and ``run(prompts, max_tokens, concurrency, **options) -> PeerResult``;
``common.run_isolated`` runs one in a fresh process so its peak memory is its own.
"""
