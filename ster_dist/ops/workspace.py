"""workspace import-pairs | show | select | remove and onboarding as plain functions; each answers
`workspace show`'s document (an import adds its set's `id` and `import`: imported, unchanged or
conflicting, the last with exit status 1: the first set was kept)."""

from __future__ import annotations

from ster_dist.schema.workspace import (
    OnboardingRequest,
    WorkspaceImportRequest,
    WorkspaceRemoveRequest,
    WorkspaceSelectRequest,
    WorkspaceShowRequest,
)


def import_pairs(request: WorkspaceImportRequest) -> dict:
    from ster_dist.steer.workspace import import_pairs as run

    document, outcome = run(request.file)
    return {**document, "import": outcome}


def show(request: WorkspaceShowRequest) -> dict:
    from ster_dist.steer.workspace import show as run

    return run()


def select(request: WorkspaceSelectRequest) -> dict:
    from ster_dist.steer.workspace import select as run

    return run(request.id)


def remove(request: WorkspaceRemoveRequest) -> dict:
    from ster_dist.steer.workspace import remove as run

    return run(request.id)


def onboarding(request: OnboardingRequest) -> dict:
    from ster_dist.steer.workspace import import_pairs as run
    from ster_dist.steer.workspace import show as replay

    if request.import_pairs is None:
        return replay()
    document, outcome = run(request.import_pairs)
    return {**document, "import": outcome}
