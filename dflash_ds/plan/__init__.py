"""`dflash-ds plan`: colocated or disaggregated, which target/drafter split, what the wire and the GPUs hold."""
