"""Sample files to device rows: the loader, its row slots and the rows on the training device."""
