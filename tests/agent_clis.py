"""The real agent CLIs (npm: @openai/codex, @anthropic-ai/claude-code, opencode-ai), run offline
against a server on 127.0.0.1.

`scripts/test.sh` installs the pinned versions below into `.agent-clis/`. Each CLI gets a fresh
HOME, its outbound features switched off by its own settings, and HTTP(S)_PROXY pointing at a
closed local port, so nothing it tries can leave the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / ".agent-clis" / "node_modules" / ".bin"
VERSIONS = {"codex": "@openai/codex@0.171.0", "claude": "@anthropic-ai/claude-code@2.1.332",
            "opencode": "opencode-ai@1.18.33"}
NOTE = "hello from the note"
ANSWER = "The note says: hello from the note."
TITLE = "Reading the note"
CLOSED_PORT = "http://127.0.0.1:9"  # discard: nothing listens, so outbound attempts fail at once


@dataclass(frozen=True)
class AgentCLI:
    name: str
    endpoint: str  # the path it generates with
    tool: str
    arguments: dict

    @property
    def task(self) -> str:
        return f"Use the tool {self.tool} to read note.txt"

    @property
    def call_text(self) -> str:
        """The tool call the model writes (the generic JSON form of server/generic_tools.py)."""
        return "<tool_call>\n" + json.dumps({"name": self.tool, "arguments": self.arguments}) + "\n</tool_call>"

    def installed(self) -> bool:
        return (BIN / self.name).exists()

    def run(self, base_url: str, model: str, workdir: Path, home: Path, timeout: float = 240) -> subprocess.CompletedProcess:
        home.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI", "ANTHROPIC", "CODEX", "OPENCODE"))}
        # PWD too: opencode takes its working directory from it, not from the process.
        env.update(HOME=str(home), PWD=str(workdir), HTTPS_PROXY=CLOSED_PORT, HTTP_PROXY=CLOSED_PORT,
                   NO_PROXY="127.0.0.1,localhost",
                   NO_COLOR="1")
        if self.name == "codex":
            config = home / ".codex"
            config.mkdir(exist_ok=True)
            (config / "config.toml").write_text(CODEX_CONFIG.replace("MODEL_ID", model).replace("BASE_URL", base_url))
            env.update(CODEX_HOME=str(config), DFLASH_API_KEY="sk-unused")
            command = ["codex", "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", self.task]
        elif self.name == "claude":
            env.update(ANTHROPIC_BASE_URL=base_url, ANTHROPIC_API_KEY="sk-unused", ANTHROPIC_MODEL=model,
                       ANTHROPIC_SMALL_FAST_MODEL=model, DISABLE_TELEMETRY="1", DISABLE_AUTOUPDATER="1",
                       CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1")
            command = ["claude", "-p", self.task, "--model", model, "--allowedTools", "Bash"]
        else:
            config = home / "opencode.json"
            config.write_text(json.dumps(opencode_config(base_url, model)))
            env.update(OPENCODE_CONFIG=str(config), OPENCODE_DISABLE_AUTOUPDATE="1", OPENCODE_DISABLE_MODELS_FETCH="1",
                       OPENCODE_DISABLE_SHARE="1", OPENCODE_DISABLE_DEFAULT_PLUGINS="1", OPENCODE_DISABLE_LSP_DOWNLOAD="1")
            command = ["opencode", "run", self.task]
        command[0] = str(BIN / command[0])
        return subprocess.run(command, cwd=workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout)


CLIS = {
    "codex": AgentCLI("codex", "/v1/responses", "exec_command", {"cmd": "cat note.txt"}),
    "claude": AgentCLI("claude", "/v1/messages", "Bash", {"command": "cat note.txt", "description": "Read the note"}),
    "opencode": AgentCLI("opencode", "/v1/chat/completions", "bash",
                         {"command": "cat note.txt", "description": "Read the note"}),
}

CODEX_CONFIG = """\
model = "MODEL_ID"
model_provider = "dflash"
check_for_update_on_startup = false
web_search = "disabled"

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"
log_user_prompt = false

[model_providers.dflash]
name = "dflash"
base_url = "BASE_URL/v1"
env_key = "DFLASH_API_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0

[features]
plugins = false
remote_plugin = false
plugin_sharing = false
apps = false
in_app_updates = false
image_generation = false
browser_use = false
browser_use_external = false
computer_use = false
tool_suggest = false
skill_mcp_dependency_install = false
"""


def opencode_config(base_url: str, model: str) -> dict:
    return {
        "$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
        "enabled_providers": ["dflash"], "model": f"dflash/{model}", "small_model": f"dflash/{model}",
        "provider": {"dflash": {
            "npm": "@ai-sdk/openai-compatible", "name": "dflash",
            "options": {"baseURL": f"{base_url}/v1", "apiKey": "sk-unused"},
            "models": {model: {"name": model, "limit": {"context": 200000, "output": 256}}}}},
    }


def generation_requests(recorded, cli: AgentCLI) -> list[dict]:
    """The bodies a CLI sent to its generation endpoint, in order."""
    return [json.loads(body) for method, path, body in recorded if method == "POST" and path == cli.endpoint]
