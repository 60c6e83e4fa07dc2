"""The job queue: jobs of every kind validated, journaled, queued by priority and run as their
operations over pooled sessions (queue.py), the pool (pool.py), the journal (journal.py), per-job
progress (events.py), following jobs (follow.py), clients (client.py), the Ray actor (actor.py),
`ster submit` (submit.py), the `ray job submit` entrypoint (entry.py) and the command line's jobs
(in_process.py)."""
