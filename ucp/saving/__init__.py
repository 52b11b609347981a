"""Saving: plan, snapshot, the synchronous save, the asynchronous saver and its backends."""
