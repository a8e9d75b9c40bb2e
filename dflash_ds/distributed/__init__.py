"""Distributed plumbing: which rank is a target or a drafter (`topology`), the
hidden-state exchange between them (`bridge`), and which target computes which
batch for which drafter (`router`). No model code lives here."""
