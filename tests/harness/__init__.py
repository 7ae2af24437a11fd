"""The test harness: tiny megatron-core models on gloo (testing) and the fork server (forked_ranks)."""
