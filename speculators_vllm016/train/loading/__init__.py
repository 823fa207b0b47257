"""Sample files to device rows: what the trainer asks of a loader, the loader, its row slots and
the rows on the training device."""
