"""The viewer's routes, mounted by the gateway at ``/ui``: GET pages, plus the login and
logout POSTs.

Store reads run on the event loop's thread (the store's rule); building a page, which
merges calls, decodes tokens and reads log files, runs in a worker thread, so a page
view during training does not hold up the proxy's recorded calls for its duration.
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Request
from starlette.datastructures import QueryParams
from starlette.responses import Response

from agl.core.config_groups import make_advantage
from agl.core.contracts.execution import AGENT_LOG_EVENT
from agl.core.contracts.queries import (
    HISTORY_SINCE,
    EventQuery,
    SortKey,
    Summary,
    SummaryQuery,
    Transition,
)
from agl.core.contracts.records import Event, Rollout, Status
from agl.core.gateway.auth import Keyring, bearer
from agl.core.gateway.query import INT64_MAX, INT64_MIN, whole_number
from agl.core.gateway.store.base import Store
from agl.ui import session, views
from agl.ui.agentlog import agent_log, recorded_logs
from agl.ui.group import LEVELS, cards
from agl.ui.render import render
from agl.ui.run import RunFolder
from agl.ui.samples import Explained, explain_attempt
from agl.ui.throttle import LoginThrottle

PAGE_SIZE = 50
MAX_PAGE = INT64_MAX // PAGE_SIZE  # the last page whose offset SQLite can bind
MAX_EVENTS = 5000  # events of one rollout on its page
MAX_GROUP = 256  # rollouts of one group on its page

# No script runs on these pages at all: if escaping ever failed, the browser would still
# refuse an injected <script>, inline handler or foreign resource.
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
_CSS = resources.files("agl.ui").joinpath("static/style.css").read_bytes()
_SORTABLE = (
    (SortKey.CREATED, "created"),
    (SortKey.REWARD, "reward"),
    (SortKey.TURNS, "turns"),
    (SortKey.TOKENS, "tokens"),
    (SortKey.DURATION, "duration"),
)


class UiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _html(body: str, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    return Response(
        body,
        status_code=status,
        media_type="text/html; charset=utf-8",
        headers={**_HEADERS, **(headers or {})},
    )


def _redirect(location: str, headers: Mapping[str, str] | None = None) -> Response:
    return Response(status_code=303, headers={**_HEADERS, "Location": location, **(headers or {})})


def router(
    store: Callable[[], Store],
    keyring: Callable[[], Keyring],
    sessions: session.Sessions,
    folder: Path | None,
) -> APIRouter:
    """The ``/ui`` routes over ``store()`` (the gateway's, once it has started); the
    admin token (of ``keyring()``, typed into ``sessions``' login) opens them; ``folder``
    is the run folder (None: samples, advantages and agent logs not shown)."""
    ui = APIRouter(prefix="/ui", include_in_schema=False)
    run = RunFolder(folder)
    throttle = LoginThrottle()

    def refusal(request: Request) -> Response | None:
        """None when the request may see the pages: the session cookie, or the admin
        token as a Bearer header (curl). An attempt key never may."""
        if sessions.valid(request.cookies.get(session.COOKIE)):
            return None
        header = request.headers.get("authorization")
        if header is not None:
            token = bearer(header)
            principal = None if token is None else keyring().identify(token)
            if principal is not None and principal.admin:
                return None
            if principal is not None:
                return _error_page(403, "an attempt key does not open the viewer")
            return _error_page(401, "invalid token")
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return _redirect(f"{session.LOGIN}?{urlencode({'next': target})}")

    def page(
        handler: Callable[..., Awaitable[Response]],
    ) -> Callable[..., Awaitable[Response]]:
        @functools.wraps(handler)
        async def guarded(request: Request, **params: Any) -> Response:
            refused = refusal(request)
            if refused is not None:
                return refused
            try:
                return await handler(request, **params)
            except UiError as error:
                return _error_page(error.status, error.message, await _run_header(run))

        return guarded

    @ui.get("/static/style.css")
    async def stylesheet() -> Response:
        return Response(_CSS, media_type="text/css", headers={"Cache-Control": "max-age=3600"})

    @ui.get("/login")
    async def login_form(request: Request) -> Response:
        target = session.safe_next(request.query_params.get("next"))
        if sessions.valid(request.cookies.get(session.COOKIE)):
            return _redirect(target)
        return _html(render("login.html", message="", next=target))

    @ui.post("/login")
    async def login(request: Request) -> Response:
        address = request.client.host if request.client else "unknown"
        wait = throttle.wait(address)
        if wait:
            retry = math.ceil(wait)
            message = f"Too many failed logins from {address}: try again in {retry} s."
            return _html(
                render("login.html", message=message, next="/ui"), 429, {"Retry-After": str(retry)}
            )
        try:
            form = session.read_form(await session.read_small_body(request))
        except session.FormTooLarge:
            message = f"The form is larger than {session.MAX_FORM_BYTES} bytes."
            return _html(render("login.html", message=message, next="/ui"), 413)
        target = session.safe_next(form.get("next"))
        typed = form.get("token", "")
        if sessions.is_admin_token(typed):
            throttle.succeeded(address)
            return _redirect(target, {"Set-Cookie": sessions.start()})
        throttle.failed(address)
        principal = keyring().identify(typed.strip()) if typed.strip() else None
        if principal is not None and not principal.admin:
            message, status = "An attempt key does not open the viewer: use the admin token.", 403
        else:
            message, status = "That is not the gateway's admin token.", 401
        return _html(render("login.html", message=message, next=target), status)

    @ui.post("/logout")
    async def logout(request: Request) -> Response:
        cleared = sessions.end(request.cookies.get(session.COOKIE))
        return _redirect(session.LOGIN, {"Set-Cookie": cleared})

    @ui.get("")
    @page
    async def rollouts(request: Request) -> Response:
        form = ListForm.parse(request.query_params)
        rows, total = await store().query_rollouts(form.query)
        return _html(render("list.html", **form.context(rows, total), run=await _run_header(run)))

    @ui.get("/rollouts/{rollout_id}")
    @page
    async def rollout(request: Request, rollout_id: str) -> Response:
        s = store()
        found = await s.get_rollout(rollout_id)
        if found is None:
            raise UiError(404, f"rollout {rollout_id!r} does not exist")
        transitions = await s.transitions(rollout_id)
        summaries = await s.summaries(rollout_id)
        events = await s.list_events(rollout_id, EventQuery(limit=MAX_EVENTS + 1))
        # Read apart: recorded at the end, they may come after the page's first events.
        logs = await s.list_events(rollout_id, EventQuery(type=AGENT_LOG_EVENT))
        since = await s.get_meta(HISTORY_SINCE)
        header = await _run_header(run)
        body = await asyncio.to_thread(
            _rollout_page, run, header, found, transitions, summaries, events, logs, since
        )
        return _html(body)

    @ui.get("/groups/{group_id:path}")
    @page
    async def group(request: Request, group_id: str) -> Response:
        s = store()
        rows, total = await s.query_rollouts(SummaryQuery(group_id=group_id, limit=MAX_GROUP))
        if not rows:
            raise UiError(404, f"group {group_id!r} has no rollouts")
        events = {
            row.rollout.rollout_id: await s.list_events(
                row.rollout.rollout_id, EventQuery(attempt=row.rollout.attempt, limit=MAX_EVENTS)
            )
            for row in rows
        }
        header = await _run_header(run)
        pairs = [(row.rollout, row.summary) for row in rows]
        body = await asyncio.to_thread(
            _group_page, run, header, group_id, pairs, events, total > len(rows)
        )
        return _html(body)

    return ui


def _error_page(status: int, message: str, header: dict[str, Any] | None = None) -> Response:
    return _html(render("error.html", status=status, message=message, run=header), status)


async def _run_header(run: RunFolder) -> dict[str, Any] | None:
    """The run as the page header names it; loading it (once) may read files."""
    info = await asyncio.to_thread(run.info)
    if info is None:
        return None
    return {"folder": str(run.folder), "choices": dict(info.choices)}


# -- the list ------------------------------------------------------------------------


@dataclass(frozen=True)
class ListRow:
    rollout_id: str
    group_id: str
    mode: str
    step: str
    status: str
    attempt: int
    created: str
    reward: str
    turns: str
    tokens: str
    duration: str
    input: str


def _list_row(rollout: Rollout, summary: Summary | None) -> ListRow:
    step = views.step_of(rollout.metadata)
    return ListRow(
        rollout_id=rollout.rollout_id,
        group_id=rollout.group_id,
        mode=rollout.mode,
        step="—" if step is None else str(step),
        status=rollout.status.value,
        attempt=rollout.attempt,
        created=views.clock(rollout.created_at),
        reward=views.number(summary.reward if summary else None),
        turns=str(summary.calls) if summary else "—",
        tokens=str(summary.tokens) if summary else "—",
        duration=views.seconds(views.duration(rollout)),
        input=views.compact(rollout.input, 80),
    )


@dataclass(frozen=True)
class ListForm:
    """The list's query string: the filters as typed (to fill the form again) and as a
    store query. A value that does not parse is a 400 that says which."""

    fields: dict[str, str]
    statuses: tuple[str, ...]
    query: SummaryQuery
    page: int

    @classmethod
    def parse(cls, params: QueryParams) -> ListForm:
        fields = {
            name: params.get(name, "").strip()
            for name in ("mode", "step", "group", "min_reward", "max_reward", "sort", "order")
        }
        statuses = tuple(s for s in params.getlist("status") if s)
        problems = []
        try:
            status_set = frozenset(Status(s) for s in statuses)
        except ValueError:
            problems.append(f"status must be one of {', '.join(s.value for s in Status)}")
            status_set = frozenset()
        if fields["mode"] not in ("", "train", "val"):
            problems.append("mode must be train or val")
        step = _whole(fields["step"], "step", INT64_MIN, problems)
        low = _reward(fields["min_reward"], "min_reward", problems)
        high = _reward(fields["max_reward"], "max_reward", problems)
        try:
            sort = SortKey(fields["sort"] or SortKey.CREATED)
        except ValueError:
            problems.append(f"sort must be one of {', '.join(k.value for k in SortKey)}")
            sort = SortKey.CREATED
        fields["sort"] = sort.value
        if fields["order"] not in ("", "asc", "desc"):
            problems.append("order must be asc or desc")
        fields["order"] = fields["order"] or "desc"
        page = _whole(params.get("page", "") or "1", "page", 1, problems, MAX_PAGE) or 1
        if problems:
            raise UiError(400, "; ".join(problems))
        query = SummaryQuery(
            statuses=status_set,
            mode=fields["mode"] or None,
            group_id=fields["group"] or None,
            step=step,
            min_reward=low,
            max_reward=high,
            sort=sort,
            descending=fields["order"] == "desc",
            offset=(page - 1) * PAGE_SIZE,
            limit=PAGE_SIZE,
        )
        return cls(fields, statuses, query, page)

    def link(self, **changes: Any) -> str:
        """This list with some parameters changed (and empty ones left out)."""
        params: list[tuple[str, str]] = [("status", s) for s in self.statuses]
        values = {**self.fields, "page": str(self.page), **changes}
        params += [(k, str(v)) for k, v in values.items() if v not in ("", None)]
        if values.get("page") in ("1", 1):
            params = [p for p in params if p[0] != "page"]
        return "/ui?" + urlencode(params) if params else "/ui"

    def context(self, rows: list[Any], total: int) -> dict[str, Any]:
        pages = max(1, math.ceil(total / PAGE_SIZE))
        sort_links = {}
        for key, _ in _SORTABLE:
            flip = (
                "asc" if self.fields["sort"] == key and self.fields["order"] == "desc" else "desc"
            )
            sort_links[key.value] = self.link(sort=key.value, order=flip, page=1)
        return {
            "form": {**self.fields, "status": self.statuses},
            "statuses": [s.value for s in Status],
            "sort_keys": [k.value for k in SortKey],
            "sortable": [(k.value, label) for k, label in _SORTABLE],
            "sort_links": sort_links,
            "rows": [_list_row(r.rollout, r.summary) for r in rows],
            "total": total,
            "page": self.page,
            "pages": pages,
            "page_links": {
                "first": self.link(page=1),
                "prev": self.link(page=self.page - 1),
                "next": self.link(page=self.page + 1),
                "last": self.link(page=pages),
            },
        }


def _whole(
    text: str, name: str, low: int, problems: list[str], high: int = INT64_MAX
) -> int | None:
    if not text:
        return None
    try:
        return whole_number(text, low, high)
    except ValueError as error:
        problems.append(f"{name} {error}, not {text[:40]!r}")
        return None


def _reward(text: str, name: str, problems: list[str]) -> float | None:
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        problems.append(f"{name} must be a number, not {text[:40]!r}")
        return None
    if not math.isfinite(value):
        problems.append(f"{name} must be finite")
        return None
    return value


# -- one rollout -----------------------------------------------------------------------


def _rollout_page(
    run: RunFolder,
    header: dict[str, Any] | None,
    rollout: Rollout,
    transitions: list[Transition],
    summaries: list[Summary],
    events: list[Event],
    logs: list[Event],
    history_since: str | None,
) -> str:
    truncated = len(events) > MAX_EVENTS
    events = events[:MAX_EVENTS]
    explained: dict[int, Explained] = {}
    decode = None
    info = run.info()
    if info is not None:
        merge = info.merge()
        decode = merge.decode
        decode_token = info.decode_token()
        for attempt in sorted({e.attempt for e in events if e.type == views.MODEL_REQUEST}):
            explained[attempt] = explain_attempt(
                events, attempt, info.choices["merge"], merge, decode_token
            )
    incomplete = history_since is not None and rollout.created_at < float(history_since)
    files = [] if run.folder is None else agent_log(run.folder, rollout.rollout_id, rollout.attempt)
    return render(
        "rollout.html",
        run=header,
        r=rollout,
        step=views.step_of(rollout.metadata),
        duration=views.duration(rollout),
        history=views.history(rollout, transitions, complete=not incomplete),
        history_incomplete=incomplete,
        attempts=views.attempts(rollout, events, summaries, decode),
        truncated=truncated,
        max_events=MAX_EVENTS,
        explained=explained,
        log=recorded_logs(logs) + files,
        folder=run.folder is not None,
    )


# -- one group -------------------------------------------------------------------------


def _group_page(
    run: RunFolder,
    header: dict[str, Any] | None,
    group_id: str,
    rows: list[tuple[Rollout, Summary | None]],
    events: dict[str, list[Event]],
    truncated: bool,
) -> str:
    info = run.info()
    merge = None
    advantages: dict[str, Any] = {}
    used = why = ""
    if info is None:
        why = run.problem or "Advantages need the run folder (its config.yaml): none was found."
    else:
        merge = info.merge()
        # Both levels with the run's options (estimator, scale), built as the trainer does.
        advantages = {
            level: make_advantage({**info.config["advantage"], "name": level}) for level in LEVELS
        }
        used = info.choices["advantage"]
    return render(
        "group.html",
        run=header,
        group_id=group_id,
        cards=cards(rows, events, merge, advantages),
        truncated=truncated,
        levels=list(advantages),
        merge=info.choices["merge"] if info else "",
        used=used,
        why_no_advantages=why,
    )
