"""Training components that know nothing about process groups: schedules, anchors, loss, metrics."""
