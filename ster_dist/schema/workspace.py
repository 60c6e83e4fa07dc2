"""workspace import-pairs | show | select | remove, and onboarding: Ster's persistent pair sets."""

from __future__ import annotations

from ster_dist.schema.base import Request, field


class WorkspaceImportRequest(Request):
    command = ("workspace", "import-pairs")
    summary = "validate a pair set, keep a canonical copy in the workspace and make it active"

    file: str = field(help="the pair set to import", cli={"positional": True})


class WorkspaceShowRequest(Request):
    command = ("workspace", "show")
    summary = "the workspace's pair sets and the active one"


class WorkspaceSelectRequest(Request):
    command = ("workspace", "select")
    summary = "make a workspace pair set the active one"

    id: str = field(help="the set's id (workspace show lists them)", cli={"positional": True})


class WorkspaceRemoveRequest(Request):
    command = ("workspace", "remove")
    summary = "remove a pair set from the workspace"

    id: str = field(help="the set's id (workspace show lists them)", cli={"positional": True})


class OnboardingRequest(Request):
    command = ("onboarding",)
    summary = "first use: import a pair set into the workspace (or replay: show what is there)"

    import_pairs: str | None = field(
        None, help="a pair set to import, as workspace import-pairs does"
    )
