"""Commands that are not a stage of training: init-drafter, train-step, ckpt, check-hostfile, report."""
