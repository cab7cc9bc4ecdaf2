"""Opt-in features the Engine offers (data sharding, metrics, throughput, profiling, the
batch-size finder, preemption, fault handling, syncbn, memory estimates, the async writer), each
typed against the contract, never against the Engine or each other."""
