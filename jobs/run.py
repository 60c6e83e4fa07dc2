"""Ray job entrypoint for every ster_dist job kind:

    ray job submit --working-dir . -- python jobs/run.py jobs/examples/generate.json

It finds (or starts) the cluster's scheduler actor, submits the spec(s), streams progress as
NDJSON on stderr and prints the result record as one JSON line on stdout; exit status 0 when
every job is done, 1 when one failed, 2 when a spec was refused. `--local` runs the same specs
through an in-process scheduler instead, without Ray. See docs/runbook.md.
"""

import sys
from pathlib import Path

# the uploaded working directory holds ster_dist beside jobs/; import that copy
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ster_dist.sched.entry import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
