"""Settings every test process shares.

Ray reads its token-authentication mode once per process, so a process that talks to two local
clusters (an embedded one a test started, then the `ray start --head` one of test_ray_jobs.py)
must see one mode for both: the actors it creates on the second die at start when the modes
differ. Every cluster here is ours, on 127.0.0.1, so authentication is off for all of them.
"""

import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
