"""An audit of the dashboard as a hostile or careless user meets it: escaping of every
user-controlled name, writes refused without their protection, bad ids and filters,
static files, a database or replica that is down, and the features docs/ui.md promises.
"""

from __future__ import annotations

import contextlib
import html
import re
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from starlette.testclient import TestClient

from cyclone_dsl import (
    Client,
    InvalidArgument,
    StepContext,
    Worker,
    step,
    wait_signal,
    workflow,
)
from cyclone_dsl.states import RunState
from cyclone_dsl.ui.app import CSRF_COOKIE, create_app

UIA_EVIL = '"><img src=x onerror=alert(1)>'
UIA_SECRET = "hunter2sekret"


@step(name="uia_echo")
def uia_echo(x: object) -> object:
    return x


@workflow(name="uia_wait")
def uia_waits(x):  # type: ignore[no-untyped-def]
    return uia_echo(wait_signal("go"))


@step(name="uia_boom" + UIA_EVIL, max_attempts=1)
def uia_boom(x: object, ctx: StepContext) -> object:
    ctx.progress(1, 2, UIA_EVIL)
    ctx.emit({UIA_EVIL: UIA_EVIL})
    raise RuntimeError(UIA_EVIL)


@workflow(name="uia_evil" + UIA_EVIL)
def uia_evil(x):  # type: ignore[no-untyped-def]
    uia_boom.named("n" + UIA_EVIL)(x)
    return wait_signal("sig" + UIA_EVIL)


@step(name="uia_big")
def uia_big(x: object) -> str:
    return "x" * 5000


@workflow(name="uia_slash")
def uia_slash(x):  # type: ignore[no-untyped-def]
    uia_big.named("exports/daily")(x)
    return wait_signal("go")


@pytest.fixture
def uia_web(client: Client) -> Iterator[TestClient]:
    with TestClient(create_app(client), raise_server_exceptions=False) as test_client:
        yield test_client


def uia_csrf(web: TestClient) -> str:
    web.get("/runs")
    return str(web.cookies.get(CSRF_COOKIE))


def uia_flash(text: str) -> list[str]:
    return [html.unescape(f) for f in re.findall(r'<p class="flash[^>]*>(.*?)</p>', text)]


def uia_run_ids(text: str) -> list[int]:
    return [int(i) for i in re.findall(r'data-run="(\d+)"', text)]


def uia_wait_for(check: Callable[[], bool], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


class UiaProxy:
    """A TCP front for the test database's socket that can be taken down (the database
    becomes unreachable for clients connected through it)."""

    def __init__(self, unix_path: str) -> None:
        self.unix_path = unix_path
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(50)
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        self.up = True
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while self.up:
            try:
                front, _ = self.listener.accept()
            except OSError:
                return
            back = socket.socket(socket.AF_UNIX)
            back.connect(self.unix_path)
            self.sockets += [front, back]
            threading.Thread(target=self._pump, args=(front, back), daemon=True).start()

    @staticmethod
    def _pump(front: socket.socket, back: socket.socket) -> None:
        try:
            while True:
                ready, _, _ = select.select([front, back], [], [], 0.5)
                for side in ready:
                    data = side.recv(65536)
                    if not data:
                        raise OSError("closed")
                    (back if side is front else front).sendall(data)
        except (OSError, ValueError):
            for side in (front, back):
                with contextlib.suppress(OSError):
                    side.close()

    def down(self) -> None:
        self.up = False
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for side in self.sockets:
            with contextlib.suppress(OSError):
                side.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                side.close()


@pytest.fixture
def uia_proxied(cyclone_dsn: str) -> Iterator[tuple[UiaProxy, Client]]:
    """A client whose DSN (with a password) reaches the database through a proxy."""
    params: dict[str, Any] = conninfo_to_dict(cyclone_dsn)
    proxy = UiaProxy(f"{params['host']}/.s.PGSQL.{params.get('port') or 5432}")
    params.update(host="127.0.0.1", port=str(proxy.port), password=UIA_SECRET)
    client = Client(make_conninfo(**params))
    try:
        yield proxy, client
    finally:
        proxy.down()
        client.close()


# -- escaping ---------------------------------------------------------------------------


def test_uia_every_page_escapes_hostile_names_errors_and_inputs(
    client: Client, uia_web: TestClient, start_worker: Callable[..., Worker]
) -> None:
    start_worker(uia_boom)
    handle = client.submit_once(uia_evil, UIA_EVIL, key="k" + UIA_EVIL)
    client.signal(handle.id, "sig" + UIA_EVIL, UIA_EVIL)
    uia_wait_for(lambda: client.get_run(handle.id).state is RunState.FAILED)
    client.schedule(uia_evil, "0 * * * *", id="s" + UIA_EVIL, location="UTC")
    pages = [
        "/runs",
        f"/runs?q={UIA_EVIL}&workflow={UIA_EVIL}",
        f"/runs/{handle.id}",
        f"/runs/{handle.id}/live",
        f"/runs/{handle.id}?items={UIA_EVIL}",
        "/queues",
        "/fleet",
        "/schedules",
        f"/runs?message={UIA_EVIL}&error={UIA_EVIL}",
    ]
    for url in pages:
        response = uia_web.get(url)
        assert response.status_code == 200, url
        assert "<img src=x" not in response.text, url
    run_page = uia_web.get(f"/runs/{handle.id}").text
    # the escaped values are shown: error text, signal name, node, workflow, progress
    assert run_page.count("&lt;img src=x onerror=alert(1)&gt;") >= 8


# -- writes and their protection --------------------------------------------------------


@pytest.mark.parametrize(
    "path", ["/runs/{id}/cancel", "/runs/{id}/pause", "/bulk/apply", "/schedules/h/disable"]
)
def test_uia_control_actions_refuse_get(client: Client, uia_web: TestClient, path: str) -> None:
    handle = client.submit(uia_waits, 1)
    client.schedule(uia_waits, "0 * * * *", id="h", location="UTC")
    response = uia_web.get(path.format(id=handle.id) + "?action=cancel&workflow=uia_wait")
    assert response.status_code == 405
    assert client.get_run(handle.id).state is RunState.RUNNING
    assert client.list_schedules()[0].enabled is True


def test_uia_a_cross_site_post_without_the_cookie_is_refused(
    client: Client, uia_web: TestClient
) -> None:
    handle = client.submit(uia_waits, 1)
    token = uia_csrf(uia_web)
    uia_web.cookies.clear()  # a forged form knows no cookie (SameSite=Strict)
    for path, data in [
        (f"/runs/{handle.id}/cancel", {}),
        ("/bulk/apply", {"action": "cancel", "workflow": "uia_wait"}),
    ]:
        refused = uia_web.post(path, data={"csrf": token, **data})
        assert refused.status_code == 403
        assert refused.headers["content-type"].startswith("application/json")
    assert client.get_run(handle.id).state is RunState.RUNNING


def test_uia_the_csrf_cookie_is_strict_and_http_only(uia_web: TestClient) -> None:
    cookie = uia_web.get("/runs").headers["set-cookie"].lower()
    assert cookie.startswith(f"{CSRF_COOKIE}=")
    assert "samesite=strict" in cookie and "httponly" in cookie


def test_uia_read_only_hides_every_form_and_refuses_every_write(client: Client) -> None:
    handle = client.submit(uia_waits, 1)
    client.pause(handle.id)
    client.schedule(uia_waits, "0 * * * *", id="h", location="UTC")
    with TestClient(create_app(client, read_only=True)) as web:
        for url in ["/runs", f"/runs/{handle.id}", f"/runs/{handle.id}/live", "/schedules"]:
            assert 'method="post"' not in web.get(url).text, url
        csrf = str(web.cookies.get(CSRF_COOKIE))
        writes = [
            (f"/runs/{handle.id}/{a}", {"node": "go", "name": "go", "payload": "1"})
            for a in ("cancel", "pause", "resume", "retry", "signal", "fork")
        ] + [
            ("/schedules/h/disable", {}),
            ("/bulk/preview", {"action": "cancel", "workflow": "uia_wait"}),
            ("/bulk/apply", {"action": "cancel", "workflow": "uia_wait"}),
        ]
        for path, data in writes:
            assert web.post(path, data={"csrf": csrf, **data}).status_code == 403, path
    assert client.get_run(handle.id).state is RunState.PAUSED
    assert client.signals_of(handle.id) == []
    assert client.list_schedules()[0].enabled is True


def test_uia_the_token_may_come_in_a_header_and_bulk_needs_it(client: Client) -> None:
    handle = client.submit(uia_waits, 1)
    with TestClient(create_app(client, token="s3cret"), raise_server_exceptions=False) as web:
        csrf = uia_csrf(web)
        form = {"csrf": csrf, "action": "cancel", "workflow": "uia_wait"}
        assert web.post("/bulk/preview", data=form).status_code == 401
        assert web.post("/bulk/apply", data=form).status_code == 401
        assert client.get_run(handle.id).state is RunState.RUNNING
        done = web.post(
            f"/runs/{handle.id}/pause",
            data={"csrf": csrf},
            headers={"x-cyclone-token": "s3cret"},
            follow_redirects=False,
        )
        assert done.status_code == 303
    assert client.get_run(handle.id).state is RunState.PAUSED


def test_uia_a_non_ascii_token_lets_its_holder_write(client: Client) -> None:
    handle = client.submit(uia_waits, 1)
    with TestClient(create_app(client, token="pässwort"), raise_server_exceptions=False) as web:
        csrf = uia_csrf(web)
        done = web.post(
            f"/runs/{handle.id}/pause",
            data={"csrf": csrf, "token": "pässwort"},
            follow_redirects=False,
        )
        assert done.status_code == 303
    assert client.get_run(handle.id).state is RunState.PAUSED


@pytest.mark.parametrize(("field", "status"), [("csrf", 403), ("token", 401)])
def test_uia_a_non_ascii_csrf_or_token_is_refused_not_a_server_error(
    client: Client, field: str, status: int
) -> None:
    handle = client.submit(uia_waits, 1)
    with TestClient(create_app(client, token="s3cret"), raise_server_exceptions=False) as web:
        form = {"csrf": uia_csrf(web), "token": "s3cret", field: "é"}
        assert web.post(f"/runs/{handle.id}/cancel", data=form).status_code == status
    assert client.get_run(handle.id).state is RunState.RUNNING


# -- bad input to the actions -----------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "problem"),
    [
        ("NaN", "not valid JSON"),
        ('"\\u0000"', "NUL"),
        ('"\\ud800"', "lone surrogate"),
        ("{", "not valid JSON"),
    ],
)
def test_uia_a_bad_signal_payload_is_a_one_line_error_and_sends_nothing(
    client: Client, uia_web: TestClient, payload: str, problem: str
) -> None:
    handle = client.submit(uia_waits, 1)
    form = {"csrf": uia_csrf(uia_web), "name": "go", "payload": payload}
    shown = uia_web.post(f"/runs/{handle.id}/signal", data=form)
    assert shown.status_code == 200
    assert any(problem in f for f in uia_flash(shown.text))
    assert client.signals_of(handle.id) == []


def test_uia_a_deeply_nested_signal_payload_is_refused_in_one_line(
    client: Client, uia_web: TestClient
) -> None:
    handle = client.submit(uia_waits, 1)
    form = {"csrf": uia_csrf(uia_web), "name": "go", "payload": "[" * 5000 + "]" * 5000}
    shown = uia_web.post(f"/runs/{handle.id}/signal", data=form)
    assert shown.status_code == 200
    assert uia_flash(shown.text)
    assert client.signals_of(handle.id) == []


def test_uia_an_unknown_schedule_action_changes_nothing(
    client: Client, uia_web: TestClient
) -> None:
    client.schedule(uia_waits, "0 * * * *", id="hourly", location="UTC")
    response = uia_web.post("/schedules/hourly/delete", data={"csrf": uia_csrf(uia_web)})
    assert client.list_schedules()[0].enabled is True
    assert response.status_code == 404


def test_uia_a_schedule_whose_id_has_a_slash_can_be_disabled(
    client: Client, uia_web: TestClient
) -> None:
    client.schedule(uia_waits, "0 * * * *", id="team/nightly", location="UTC")
    page = uia_web.get("/schedules").text
    action = re.findall(r'<form method="post" action="([^"]*/disable)"', page)
    assert len(action) == 1
    uia_web.post(html.unescape(action[0]), data={"csrf": str(uia_web.cookies[CSRF_COOKIE])})
    assert client.list_schedules()[0].enabled is False


def test_uia_a_run_action_on_bad_ids_is_a_404_and_changes_nothing(
    client: Client, uia_web: TestClient
) -> None:
    handle = client.submit(uia_waits, 1)
    csrf = uia_csrf(uia_web)
    for run_id in ("abc", "-1", "99999999999999999999999", "0"):
        response = uia_web.post(f"/runs/{run_id}/cancel", data={"csrf": csrf})
        assert response.status_code == 404, run_id
        assert response.headers["content-type"].startswith("application/json")
    unknown = uia_web.post(f"/runs/{handle.id}/explode", data={"csrf": csrf})
    assert unknown.status_code == 404
    assert client.get_run(handle.id).state is RunState.RUNNING


def test_uia_a_non_numeric_run_id_is_named_in_the_404(uia_web: TestClient) -> None:
    response = uia_web.get("/runs/abc")
    assert response.status_code == 404
    assert "abc" in response.json()["error"]


# -- reads: ids, filters, paging, routes, static files ----------------------------------


@pytest.mark.parametrize(
    ("url", "status"),
    [
        ("/runs?before_id=99999999999999999999", 400),
        ("/runs?before_id=ten", 400),
        ("/runs?parent=99999999999999999999", 400),
        ("/runs?q=%00", 400),
        ("/runs?workflow=a%00b", 400),
        ("/runs?since=yesterday", 400),
        ("/runs?since=2026-01-01T00:00", 400),
        ("/api/runs?state=bogus", 400),
        ("/fleet?range=1y", 400),
        ("/runs/99999999999999999999", 404),
        ("/api/runs/99999999999999999999", 404),
        ("/api/runs/-1/attempts", 404),
        ("/runs/1/live", 404),
        ("/runs/1/steps/x/output.json", 404),
    ],
)
def test_uia_bad_ids_and_filters_are_typed_json_errors(
    uia_web: TestClient, url: str, status: int
) -> None:
    response = uia_web.get(url)
    assert response.status_code == status
    assert response.headers["content-type"].startswith("application/json")
    assert set(response.json()) == {"error"}
    assert "Traceback" not in response.text


def test_uia_negative_and_huge_paging_cursors_are_harmless(
    client: Client, uia_web: TestClient
) -> None:
    handle = client.submit(uia_waits, 1)
    assert uia_web.get("/runs", params={"before_id": "-5"}).status_code == 200
    assert uia_ids_of_api(uia_web, {"before_id": str(2**63 - 1)}) == [handle.id]
    assert uia_ids_of_api(uia_web, {"before_id": "0"}) == []
    assert uia_web.get("/runs", params={"q": "a" * 60000}).status_code == 200


def uia_ids_of_api(web: TestClient, params: dict[str, str]) -> list[int]:
    response = web.get("/api/runs", params=params)
    assert response.status_code == 200
    return [r["id"] for r in response.json()]


@pytest.mark.parametrize(
    "path",
    [
        "/static/../app.py",
        "/static/%2e%2e/app.py",
        "/static/..%2fapp.py",
        "/static/%2e%2e%2f%2e%2e%2fpyproject.toml",
        "/static//etc/passwd",
        "/static/templates/../../app.py",
    ],
)
def test_uia_static_files_do_not_serve_outside_their_folder(uia_web: TestClient, path: str) -> None:
    response = uia_web.get(path)
    assert response.status_code == 404
    assert "import" not in response.text and "root:" not in response.text


def test_uia_pages_apis_and_downloads_have_their_content_types(
    client: Client, uia_web: TestClient
) -> None:
    handle = client.submit(uia_waits, 1)
    client.signal(handle.id, "go", {"x": 1})
    for url in ["/runs", f"/runs/{handle.id}", "/queues", "/fleet", "/schedules"]:
        assert uia_web.get(url).headers["content-type"].startswith("text/html"), url
    for url in [
        "/api/counts",
        "/api/stats",
        "/api/runs",
        f"/api/runs/{handle.id}",
        f"/api/runs/{handle.id}/attempts",
        "/api/workers",
    ]:
        assert uia_web.get(url).headers["content-type"] == "application/json", url
    live = uia_web.get(f"/runs/{handle.id}/live")
    assert live.headers["cache-control"] == "no-store"
    download = uia_web.get(f"/runs/{handle.id}/steps/go/output.json")
    assert download.headers["content-type"] == "application/json"
    assert download.headers["content-disposition"].startswith("attachment")
    assert download.json() == {"x": 1}
    unknown = uia_web.get("/no/such/page")
    assert unknown.status_code == 404 and "Traceback" not in unknown.text


def test_uia_older_runs_keeps_the_filters_and_pages_without_overlap(
    client: Client, uia_web: TestClient
) -> None:
    ids = [client.submit(uia_waits, i).id for i in range(53)]
    client.cancel(ids[0])
    first = uia_web.get("/runs", params={"workflow": "uia_wait", "state": "running"}).text
    listed = uia_run_ids(first)
    assert listed == sorted(ids[1:], reverse=True)[:50]
    older = re.findall(r'<a href="(/runs\?[^"]*)" rel="next"', first)
    assert len(older) == 1 and "workflow=uia_wait" in older[0] and "state=running" in older[0]
    second = uia_web.get(html.unescape(older[0])).text
    assert uia_run_ids(second) == sorted(ids[1:], reverse=True)[50:]
    assert 'rel="next"' not in second


def test_uia_the_text_filter_ignores_case_and_reads_the_submit_key(
    client: Client, uia_web: TestClient
) -> None:
    keyed = client.submit_once(uia_waits, {"who": "Alice"}, key="Order-ABC").id
    other = client.submit(uia_waits, {"who": "bob"}).id
    for text in ("order-abc", "ORDER-A", "alice", "ALICE"):
        assert uia_run_ids(uia_web.get("/runs", params={"q": text}).text) == [keyed], text
    assert uia_run_ids(uia_web.get("/runs", params={"q": "BOB"}).text) == [other]


# -- bulk -------------------------------------------------------------------------------


def test_uia_bulk_resume_by_state_counts_then_acts(client: Client, uia_web: TestClient) -> None:
    paused = [client.submit(uia_waits, i).id for i in range(2)]
    for run_id in paused:
        client.pause(run_id)
    running = client.submit(uia_waits, 9).id
    form = {"csrf": uia_csrf(uia_web), "action": "resume", "state": "paused"}
    confirm = uia_web.post("/bulk/preview", data=form)
    assert 'data-matched="2"' in confirm.text
    assert {client.get_run(r).state for r in paused} == {RunState.PAUSED}
    done = uia_web.post("/bulk/apply", data=form, follow_redirects=False)
    assert done.status_code == 303
    assert "resume%3A+2+of+2+matching+runs" in done.headers["location"]
    assert {client.get_run(r).state for r in [*paused, running]} == {RunState.RUNNING}


def test_uia_bulk_takes_every_error_kind_the_runs_list_filters_by(
    client: Client, uia_web: TestClient
) -> None:
    client.submit(uia_waits, 1)
    listed = uia_web.get("/runs", params={"error_kind": "reclaimed"})
    assert listed.status_code == 200
    assert 'name="error_kind" value="reclaimed"' in listed.text  # the bulk form takes it
    form = {"csrf": str(uia_web.cookies[CSRF_COOKIE]), "action": "cancel"}
    confirm = uia_web.post(
        "/bulk/preview", data={**form, "error_kind": "reclaimed"}, follow_redirects=False
    )
    assert confirm.status_code == 200, uia_flash(uia_web.get(confirm.headers["location"]).text)


# -- the run page -----------------------------------------------------------------------


def test_uia_the_output_of_a_node_with_a_slash_can_be_downloaded(
    client: Client, uia_web: TestClient, start_worker: Callable[..., Worker]
) -> None:
    start_worker(uia_big)
    handle = client.submit(uia_slash, 1)
    uia_wait_for(lambda: client.get_run(handle.id).step("exports/daily").output is not None)
    page = uia_web.get(f"/runs/{handle.id}").text
    links = re.findall(r'href="([^"]*output\.json)">download', page)
    assert len(links) == 1
    downloaded = uia_web.get(html.unescape(links[0]))
    assert downloaded.status_code == 200
    assert downloaded.json() == "x" * 5000


def test_uia_the_live_part_stops_when_the_run_ends(client: Client, uia_web: TestClient) -> None:
    handle = client.submit(uia_waits, 1)
    live = uia_web.get(f"/runs/{handle.id}/live").text
    assert 'data-terminal="false"' in live
    form = {"csrf": uia_csrf(uia_web)}
    assert uia_web.post(f"/runs/{handle.id}/cancel", data=form).status_code == 200
    live = uia_web.get(f"/runs/{handle.id}/live").text
    assert 'data-terminal="true"' in live
    assert f'action="/runs/{handle.id}/cancel"' not in live


# -- the database or the replica is down ------------------------------------------------


def test_uia_a_lost_database_gives_the_typed_page_without_the_password(
    uia_proxied: tuple[UiaProxy, Client],
) -> None:
    proxy, client = uia_proxied
    client.submit(uia_waits, 1)
    with TestClient(create_app(client), raise_server_exceptions=False) as web:
        assert web.get("/runs").status_code == 200
        proxy.down()
        page = web.get("/runs")
        assert page.status_code == 503
        assert page.headers["content-type"].startswith("text/html")
        assert "data-unavailable" in page.text
        assert UIA_SECRET not in page.text and "Traceback" not in page.text


def test_uia_a_database_that_is_down_is_reported_promptly(
    uia_proxied: tuple[UiaProxy, Client],
) -> None:
    proxy, client = uia_proxied
    answered: list[int] = []
    with TestClient(create_app(client), raise_server_exceptions=False) as web:
        assert web.get("/runs").status_code == 200
        proxy.down()
        assert web.get("/runs").status_code == 503  # the lost connection: at once
        asking = threading.Thread(
            target=lambda: answered.append(web.get("/api/counts").status_code), daemon=True
        )
        asking.start()
        asking.join(3)
        in_time = list(answered)
        client.close()  # wakes a call still waiting for a connection
        asking.join(10)
    assert in_time == [503], "no answer within 3 s"


def test_uia_a_replica_that_is_down_gives_a_typed_page_and_actions_still_work(
    client: Client,
) -> None:
    handle = client.submit(uia_waits, 1)
    down = f"postgresql://rep:{UIA_SECRET}@127.0.0.1:1/replica?connect_timeout=2"
    with TestClient(create_app(client, read_dsn=down), raise_server_exceptions=False) as web:
        page = web.get("/runs")
        assert page.status_code == 503
        assert "read replica is unavailable" in page.text
        assert UIA_SECRET not in page.text
        api = web.get("/api/counts")
        assert api.status_code == 503 and UIA_SECRET not in api.text
        # a page loaded before the replica went down holds the CSRF cookie and its forms
        web.cookies.set(CSRF_COOKIE, "before")
        done = web.post(
            f"/runs/{handle.id}/cancel", data={"csrf": "before"}, follow_redirects=False
        )
        assert done.status_code == 303
    assert client.get_run(handle.id).state is RunState.CANCELLED


def test_uia_an_empty_token_is_refused(client: Client) -> None:
    """An empty token would be matched by a request that sends none: writes unprotected."""
    with pytest.raises(InvalidArgument, match="token"):
        create_app(client, token="")


def test_uia_an_unknown_error_kind_filter_is_a_bad_request(
    client: Client, uia_web: TestClient
) -> None:
    """As an unknown state is: not an empty list that looks like "no such runs"."""
    client.submit(uia_waits, 1)
    response = uia_web.get("/runs", params={"error_kind": "bogus"})
    assert response.status_code == 400
    assert "'bogus' is not an error kind" in response.json()["error"]
    with pytest.raises(InvalidArgument, match="'bogus' is not an error kind"):
        client.list_runs(error_kind="bogus")
    assert client.list_runs(error_kind="reclaimed") == []
