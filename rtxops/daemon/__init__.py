"""The rtxops daemon: the job supervisor and the FastAPI app around receiver, plans, jobs and dashboard."""
