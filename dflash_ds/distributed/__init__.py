"""Distributed plumbing: which rank is a target or a drafter and which target feeds which drafter
(`layout`), the process groups each rank gets (`topology`, on `backends`), and the hidden-state
exchange between them (`payload` on the wire, `bridge` moving it, `wire` what a batch holds).
No model code lives here."""
