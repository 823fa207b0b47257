"""Draft training: data loading, vocabulary mapping, trainer."""
