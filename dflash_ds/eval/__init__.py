"""Evaluation of a drafter by real speculative decoding against its target (chain and tree drafting)."""
