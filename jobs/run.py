"""Ray job entrypoint for every ster_dist job kind:

    ray job submit --working-dir . -- python jobs/run.py jobs/examples/generate.json

It finds (or starts) the cluster's job-queue actor, submits the spec(s), streams progress as
NDJSON on stderr and prints the result record as one JSON line on stdout; exit status 0 when
every job is done, 1 when one failed, 2 when a spec was refused. `--local` runs the same specs
through an in-process job queue instead, without Ray. See docs/runbook.md.
"""

import sys
from pathlib import Path

# the uploaded working directory holds ster_dist beside jobs/; import that copy
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ster_dist.cli import parse_command  # noqa: E402
from ster_dist.errors import Refusal  # noqa: E402
from ster_dist.jobqueue.entry import run_jobs  # noqa: E402
from ster_dist.schema.jobs import RunJobsRequest  # noqa: E402


def main(argv=None) -> int:
    try:
        request = parse_command(RunJobsRequest, argv, "jobs/run.py")
    except Refusal as refusal:
        print(str(refusal), file=sys.stderr, flush=True)
        return 2
    return run_jobs(request)


if __name__ == "__main__":
    sys.exit(main())
