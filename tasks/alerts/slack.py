"""Slack delivery: an incoming webhook, or a bot token posting to a channel (slack-sdk).

`deliver` never raises for a delivery that failed: it returns a `Delivery` saying why, which the
caller records and may retry. The webhook URL and the token are secrets: they appear in no log,
no repr and no error message (`SlackTarget.describe()` is the safe name).
"""

from __future__ import annotations

import ipaddress
import logging
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from slack_sdk.errors import SlackApiError
from slack_sdk.http_retry import (
    ConnectionErrorRetryHandler,
    RateLimitErrorRetryHandler,
    RetryHandler,
    RetryIntervalCalculator,
)
from slack_sdk.http_retry.builtin_handlers import ServerErrorRetryHandler
from slack_sdk.http_retry.builtin_interval_calculators import (
    BackoffRetryIntervalCalculator,
    FixedValueRetryIntervalCalculator,
)
from slack_sdk.http_retry.request import HttpRequest
from slack_sdk.http_retry.response import HttpResponse
from slack_sdk.http_retry.state import RetryState
from slack_sdk.web import WebClient
from slack_sdk.webhook import WebhookClient

from spotrun.tasks.alerts.message import SlackMessage
from spotrun.trainer.errors import ConfigError
from spotrun.trainer.redact import redact

WEBHOOK_SETTING = "SPOTRUN_SLACK_WEBHOOK_URL"
TOKEN_SETTING = "SPOTRUN_SLACK_TOKEN"
CHANNEL_SETTING = "SPOTRUN_SLACK_CHANNEL"
API_URL_SETTING = "SPOTRUN_SLACK_API_URL"
# The Prefect Secret block asked for each setting the environment leaves unset.
SECRET_BLOCKS = {
    WEBHOOK_SETTING: "spotrun-slack-webhook-url",
    TOKEN_SETTING: "spotrun-slack-token",
    CHANNEL_SETTING: "spotrun-slack-channel",
}
DEFAULT_API_URL = "https://slack.com/api/"
WEBHOOK_CHANNEL = "slack-webhook"
API_CHANNEL = "slack-api"

# A Slack API error -> what to do about it.
_API_FIXES = {
    "invalid_auth": f"the bot token is not valid: set {TOKEN_SETTING} (or the Secret block"
    f" {SECRET_BLOCKS[TOKEN_SETTING]}) to the app's Bot User OAuth Token (xoxb-…)",
    "not_authed": f"no bot token reached Slack: set {TOKEN_SETTING} (or the Secret block"
    f" {SECRET_BLOCKS[TOKEN_SETTING]})",
    "token_revoked": f"the bot token was revoked: reinstall the Slack app and set {TOKEN_SETTING} anew",
    "account_inactive": f"the bot token's app or user is deactivated: reinstall the app, set {TOKEN_SETTING}",
    "missing_scope": "the bot token lacks the chat:write scope: add it in the app's OAuth settings and"
    " reinstall the app",
    "channel_not_found": f"no channel {{channel}} the bot can see: check {CHANNEL_SETTING} (a channel ID"
    " like C0123456789 always works) and invite the bot to private channels",
    "not_in_channel": "the bot is not in {channel}: type /invite @your-bot in that channel",
    "is_archived": f"channel {{channel}} is archived: unarchive it or set {CHANNEL_SETTING} to another",
    "ratelimited": "Slack rate-limited the bot and the retries ran out",
}
# An incoming-webhook error body -> what to do about it.
_WEBHOOK_FIXES = {
    "no_service": f"the webhook URL was revoked or is wrong: make a new one in the Slack app's settings"
    f" and set {WEBHOOK_SETTING}",
    "invalid_token": f"the webhook URL is wrong: copy it again from the Slack app and set {WEBHOOK_SETTING}",
    "no_team": f"the webhook's workspace is gone: make a new webhook and set {WEBHOOK_SETTING}",
    "channel_is_archived": f"the webhook's channel is archived: unarchive it, or make a new webhook and"
    f" set {WEBHOOK_SETTING}",
    "action_prohibited": "a workspace admin restricts posting to the webhook's channel",
    "invalid_payload": "Slack refused the message (a bug in spotrun's message builder: please report it)",
    "invalid_blocks": "Slack refused the blocks (a bug in spotrun's message builder: please report it)",
}


class SlackConfigError(ConfigError):
    """The Slack settings are incomplete or malformed; the message says which setting to fix."""


@dataclass(frozen=True, repr=False)
class SlackTarget:
    """Where alerts go: an incoming webhook, or a bot token and a channel (`api_url`: the Web API)."""

    webhook_url: str | None = None
    token: str | None = None
    channel: str | None = None
    api_url: str = DEFAULT_API_URL  # WebClient's base_url; tests point it at 127.0.0.1

    def __post_init__(self) -> None:
        if self.webhook_url:
            if not _secure_url(self.webhook_url):
                raise SlackConfigError(
                    f"{WEBHOOK_SETTING} is not an https URL (plain http only to loopback): copy it again"
                    " from Slack"
                )
        elif not (self.token and self.channel):
            raise SlackConfigError(
                f"a Slack target needs {WEBHOOK_SETTING}, or both {TOKEN_SETTING} and {CHANNEL_SETTING}"
            )
        if not (self.api_url.endswith("/") and _secure_url(self.api_url)):
            raise SlackConfigError(
                f"{API_URL_SETTING}={redact(self.api_url)!r} must be an https URL ending in '/' (plain http"
                f" only to loopback), e.g. {DEFAULT_API_URL}"
            )

    @property
    def channel_kind(self) -> str:
        return WEBHOOK_CHANNEL if self.webhook_url else API_CHANNEL

    def describe(self) -> str:
        """A name for logs: never the token, never the webhook URL's secret path."""
        if self.webhook_url:
            return f"Slack webhook {_host(self.webhook_url)}/…"
        return f"Slack channel {self.channel} via {_host(self.api_url)}"

    def __repr__(self) -> str:
        return f"SlackTarget({self.describe()})"


def target_from_env(
    environ: Mapping[str, str], secret: Callable[[str], str | None] = lambda name: None
) -> SlackTarget | None:
    """The Slack target from SPOTRUN_SLACK_* (else the spotrun-slack-* Secret blocks); None: not configured.

    A webhook wins over a bot token. A token without a channel (or the reverse) is an error, not a
    silent "no Slack": the person who set one of them expects alerts.
    """

    def setting(name: str) -> str | None:
        value = environ.get(name, "").strip()
        return value or (secret(SECRET_BLOCKS[name]) or "").strip() or None

    api_url = environ.get(API_URL_SETTING, "").strip() or DEFAULT_API_URL
    api_url = api_url if api_url.endswith("/") else api_url + "/"
    webhook = setting(WEBHOOK_SETTING)
    if webhook:
        return SlackTarget(webhook_url=webhook, api_url=api_url)
    token, channel = setting(TOKEN_SETTING), setting(CHANNEL_SETTING)
    if token and channel:
        return SlackTarget(token=token, channel=channel, api_url=api_url)
    if token or channel:
        given, missing, example = (
            (TOKEN_SETTING, CHANNEL_SETTING, "#training-alerts")
            if token
            else (CHANNEL_SETTING, TOKEN_SETTING, "xoxb-…")
        )
        raise SlackConfigError(
            f"{given} is set but {missing} is not: set {missing} (e.g. {example}) in the environment"
            f" or as the Prefect Secret block {SECRET_BLOCKS[missing]!r}, or unset {given}"
        )
    return None


@dataclass(frozen=True)
class Delivery:
    ok: bool
    status: int | None  # the last HTTP status (None: no answer)
    attempts: int  # HTTP requests made, retries included
    error: str  # one line, with the fix when known ("" when ok)
    channel: str  # "slack-webhook" or "slack-api"


def deliver(
    target: SlackTarget,
    message: SlackMessage,
    *,
    retries: int = 2,
    timeout_s: float = 10,
    retry_interval_s: float | None = None,
) -> Delivery:
    """Post `message`, retrying connection errors, 429 (after Retry-After) and 500/503 `retries` times.

    `retry_interval_s`: the pause before retrying a connection error or a 5xx; None: exponential
    backoff from 0.5 s, with jitter.
    """
    tally = _Tally()
    interval: RetryIntervalCalculator = (
        BackoffRetryIntervalCalculator()
        if retry_interval_s is None
        else FixedValueRetryIntervalCalculator(retry_interval_s)
    )
    handlers: list[RetryHandler] = [
        _Counted(ConnectionErrorRetryHandler(max_retry_count=retries, interval_calculator=interval), tally),
        _Counted(RateLimitErrorRetryHandler(max_retry_count=retries), tally),
        _Counted(ServerErrorRetryHandler(max_retry_count=retries, interval_calculator=interval), tally),
    ]
    timeout = max(1, math.ceil(timeout_s))  # slack-sdk takes whole seconds
    if target.webhook_url:
        return _post_webhook(target.webhook_url, message, handlers, timeout=timeout, tally=tally)
    return _post_api(target, message, handlers, timeout=timeout, tally=tally)


def _post_webhook(
    url: str, message: SlackMessage, handlers: list[RetryHandler], *, timeout: int, tally: _Tally
) -> Delivery:
    client = WebhookClient(url, timeout=timeout, retry_handlers=handlers, logger=_sdk_logger())
    try:
        resp = client.send(text=message.text, blocks=message.blocks)
    except Exception as e:  # the boundary: any transport failure becomes a failed Delivery to record
        error = f"no answer from {_host(url)}: {_one_line(e, hide=(url, urlsplit(url).path))}"
        return Delivery(False, None, tally.requests, error=error, channel=WEBHOOK_CHANNEL)
    if resp.status_code == 200:
        return Delivery(True, 200, tally.requests, error="", channel=WEBHOOK_CHANNEL)
    body = _one_line(resp.body or "")[:200]
    fix = _WEBHOOK_FIXES.get(body, "")
    error = f"webhook answered HTTP {resp.status_code} {body}" + (f": {fix}" if fix else "")
    return Delivery(False, resp.status_code, tally.requests, error=error, channel=WEBHOOK_CHANNEL)


def _post_api(
    target: SlackTarget, message: SlackMessage, handlers: list[RetryHandler], *, timeout: int, tally: _Tally
) -> Delivery:
    client = WebClient(
        token=target.token,
        base_url=target.api_url,
        timeout=timeout,
        retry_handlers=handlers,
        logger=_sdk_logger(),
    )
    try:
        resp = client.chat_postMessage(channel=target.channel or "", text=message.text, blocks=message.blocks)
    except SlackApiError as e:
        status, data = e.response.status_code, e.response.data
        code = str(data.get("error", "")) if isinstance(data, dict) else str(data)
        if not re.fullmatch(r"[a-z0-9_]+", code):  # not an error code: a proxy's or an outage's page
            error = f"Slack API answered HTTP {status}: {_one_line(code)[:200]}"
            return Delivery(False, status, tally.requests, error=error, channel=API_CHANNEL)
        fix = _API_FIXES.get(code, "").format(channel=target.channel)
        error = f"Slack API error {code} (HTTP {status})" + (f": {fix}" if fix else "")
        return Delivery(False, status, tally.requests, error=error, channel=API_CHANNEL)
    except Exception as e:  # the boundary: any transport failure becomes a failed Delivery to record
        error = f"no answer from {_host(target.api_url)}: {_one_line(e, hide=(target.token or '',))}"
        return Delivery(False, None, tally.requests, error=error, channel=API_CHANNEL)
    return Delivery(True, resp.status_code, tally.requests, error="", channel=API_CHANNEL)


@dataclass
class _Tally:
    retries: int = 0

    @property
    def requests(self) -> int:
        return 1 + self.retries


class _Counted(RetryHandler):
    """A retry handler that counts the retries it grants (slack-sdk reports no request count)."""

    def __init__(self, inner: RetryHandler, tally: _Tally) -> None:
        super().__init__(inner.max_retry_count, inner.interval_calculator)
        self._inner = inner
        self._tally = tally

    def can_retry(
        self,
        *,
        state: RetryState,
        request: HttpRequest,
        response: HttpResponse | None = None,
        error: Exception | None = None,
    ) -> bool:
        return self._inner.can_retry(state=state, request=request, response=response, error=error)

    def prepare_for_next_attempt(
        self,
        *,
        state: RetryState,
        request: HttpRequest,
        response: HttpResponse | None = None,
        error: Exception | None = None,
    ) -> None:
        self._inner.prepare_for_next_attempt(state=state, request=request, response=response, error=error)
        self._tally.retries += 1


def _sdk_logger() -> logging.Logger:
    # At INFO and below slack-sdk logs request URLs, and a webhook URL is a secret.
    sdk_log = logging.getLogger(f"{__name__}.sdk")
    sdk_log.setLevel(logging.WARNING)
    return sdk_log


def _secure_url(url: str) -> bool:
    """https, or plain http to a loopback address (tests post to 127.0.0.1)."""
    parts = urlsplit(url)
    if not parts.netloc:
        return False
    return parts.scheme == "https" or (parts.scheme == "http" and _loopback(parts.hostname or ""))


def _loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or '?'}" + (f":{parts.port}" if parts.port else "")


def _one_line(e: object, hide: tuple[str, ...] = ()) -> str:
    """`e` on one line, its secrets (`hide`, URL credentials) replaced before it is cut to length."""
    text = str(e)
    for secret in sorted((h for h in hide if len(h) > 1), key=len, reverse=True):  # the URL before its path
        text = text.replace(secret, "…")
    text = " ".join(redact(text).split())
    return f"{type(e).__name__}: {text}"[:300] if isinstance(e, BaseException) else text
