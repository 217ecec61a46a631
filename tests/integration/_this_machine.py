"""A Ray cluster launcher provider (`provider: {type: external, module: ...}`) whose one node
is this machine, reached without SSH: `ray up`, `ray submit` and `ray exec` run their own
code, and only the transport (an SSH command runner) is swapped for a local shell in the
provider's `home`. This machine has no SSH server; nothing else is stood in for."""
import json
import os
import shutil
import subprocess

from ray.autoscaler.command_runner import CommandRunnerInterface
from ray.autoscaler.node_provider import NodeProvider


class LocalRunner(CommandRunnerInterface):
    def __init__(self, home):
        self.home = home

    def _x(self, path):
        return path.replace("~", self.home, 1) if path.startswith("~") else path

    def run(self, cmd=None, timeout=120, exit_on_fail=False, port_forward=None,
            with_output=False, environment_variables=None, run_env="auto",
            ssh_options_override_ssh_key="", shutdown_after_run=False, silent=False):
        env = dict(os.environ, HOME=self.home)
        for k, v in (environment_variables or {}).items():
            env[k] = v if isinstance(v, str) else json.dumps(v)
        p = subprocess.run(["bash", "-c", cmd or "true"], env=env, cwd=self.home,
                           capture_output=True, text=True)
        with open(os.path.join(self.home, "runner.log"), "a") as f:
            f.write(f"$ {cmd}\n{p.stdout}{p.stderr}rc={p.returncode}\n")
        if p.returncode != 0:
            if exit_on_fail:
                raise SystemExit(p.returncode)
            raise subprocess.CalledProcessError(p.returncode, cmd, p.stdout, p.stderr)
        if not silent and not with_output:
            print(p.stdout, end="")
        return p.stdout.encode() if with_output else ""

    def run_rsync_up(self, source, target, options=None):
        target = self._x(target)
        os.makedirs(os.path.dirname(target.rstrip("/")) or ".", exist_ok=True)
        if os.path.isdir(source):
            shutil.copytree(source, target, dirs_exist_ok=True)
        else:
            shutil.copy(source, target)

    def run_rsync_down(self, source, target, options=None):
        source = self._x(source)
        if os.path.isdir(source):
            shutil.copytree(source, target, dirs_exist_ok=True)
        else:
            shutil.copy(source, target)

    def remote_shell_command_str(self):
        return "bash"

    def run_init(self, *, as_head, file_mounts, sync_run_yet):
        return None


class ThisMachine(NodeProvider):
    def __init__(self, provider_config, cluster_name):
        super().__init__(provider_config, cluster_name)
        self.home = provider_config["home"]
        self.state = os.path.join(self.home, f"nodes-{cluster_name}.json")

    def _load(self):
        try:
            with open(self.state) as f:
                return json.load(f)
        except OSError:
            return {}

    def _save(self, s):
        with open(self.state, "w") as f:
            json.dump(s, f)

    def non_terminated_nodes(self, tag_filters):
        return [n for n, tags in self._load().items()
                if all(tags.get(k) == v for k, v in tag_filters.items())]

    def is_running(self, node_id):
        return node_id in self._load()

    def is_terminated(self, node_id):
        return node_id not in self._load()

    def node_tags(self, node_id):
        return self._load().get(node_id, {})

    def external_ip(self, node_id):
        return "127.0.0.1"

    def internal_ip(self, node_id):
        return "127.0.0.1"

    def create_node(self, node_config, tags, count):
        s = self._load()
        s["this-machine"] = dict(tags)
        self._save(s)

    def set_node_tags(self, node_id, tags):
        s = self._load()
        s[node_id].update(tags)
        self._save(s)

    def terminate_node(self, node_id):
        s = self._load()
        s.pop(node_id, None)
        self._save(s)

    @staticmethod
    def bootstrap_config(cluster_config):
        return cluster_config

    def get_command_runner(self, log_prefix, node_id, auth_config, cluster_name,
                           process_runner, use_internal_ip, docker_config=None):
        return LocalRunner(self.home)
