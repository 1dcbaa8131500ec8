"""The roseinfer worker: an RQ worker that batches many jobs at once in one engine."""
