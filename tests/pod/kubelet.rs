//! A kubelet's part, played with real processes: a pod spec as `lameduck inject` writes it is
//! started and deleted in the order the kubelet uses (Kubernetes 1.29+ native sidecars).
//!
//! - The pod gets a network namespace of its own (`ip netns`), with only loopback up, so its
//!   fixed ports (4143, 4191, 8080) are its own; every container and hook runs in it.
//! - Volumes are `emptyDir` folders (mode 0777, as the kubelet makes them). There is no mount
//!   namespace per container: a path under one of the container's `mountPath`s, in its
//!   command, args, env values and hook commands, is translated to the volume's folder, and a
//!   path the image holds (`/usr/local/bin/lameduck`) to the file the test gives for it.
//!   The termination message path (`/dev/termination-log`) is a file of the container's own
//!   ([`Pod::termination_message`]), as the kubelet bind-mounts one. Nothing else of the spec
//!   is rewritten. Environment values come from `value`, or from the
//!   downward API's `status.hostIP` ([`HOST_IP`]) and `status.podIP` ([`Pod::set_ip`]; loopback
//!   until set).
//! - Each container is the init of a PID namespace of its own, and its hooks run inside it
//!   (as a runtime's exec does), so that what a hook leaves behind dies with the container.
//! - `runAsUser`/`runAsGroup` are honoured (no supplementary groups), `allowPrivilegeEscalation:
//!   false` sets no_new_privs, `capabilities: {drop: [ALL]}` empties the bounding and
//!   inheritable sets (setpriv) but for the capabilities `add` names, and `readOnlyRootFilesystem: true` gives the container (and its
//!   hooks) a mount namespace whose root is read-only, but for the volumes it mounts
//!   read-write.
//! - Start: init containers in order; one with `restartPolicy: Always` (a native sidecar) is
//!   left running once its startup probe (httpGet) passes; then the app containers, each with
//!   its postStart hook (exec).
//! - Deletion: every container's preStop hook at once (a sidecar's too), each app container's
//!   SIGTERM after its own hook; once every app container has exited (and the sidecars'
//!   hooks have returned), the sidecars get SIGTERM in reverse order; anything still
//!   running at `terminationGracePeriodSeconds` (counted from the hooks' start) is SIGKILLed.
//!   In legacy mode (the proxy an ordinary container) every container is treated so at once.
//! - Restart of one container (a failed liveness probe): its preStop hook, SIGTERM, then it
//!   starts again with its postStart hook.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use serde_json::Value;

/// Where a container finds its termination message file (`terminationMessagePath`'s default).
const TERMINATION_MESSAGE_PATH: &str = "/dev/termination-log";

/// What an image holds: the entrypoint, and files at fixed paths.
#[derive(Clone)]
pub struct Image {
    pub entrypoint: Vec<String>,
    pub files: Vec<(String, PathBuf)>,
}

pub use crate::support::netns::NetNs;

/// The node's address, as the downward API gives it (`status.hostIP`): none of the test's
/// peers uses it, as none of a cluster's clients comes from the node's own address.
pub const HOST_IP: &str = "10.79.255.254";

/// What happened, when (from the pod's creation), in order: the kubelet's actions and every
/// line the containers and hooks printed.
#[derive(Clone)]
pub struct Timeline {
    born: Instant,
    events: Arc<Mutex<Vec<(Duration, String)>>>,
    /// Output streams still being read, and the signal that one reached its end.
    reading: Arc<(Mutex<usize>, std::sync::Condvar)>,
}

impl Timeline {
    fn new() -> Timeline {
        Timeline {
            born: Instant::now(),
            events: Arc::default(),
            reading: Arc::default(),
        }
    }

    /// Waits (at most `limit`) until every output stream has been read to its end: a
    /// container's last lines are in the timeline once it has exited, not only once its
    /// reader thread next runs.
    pub fn settle(&self, limit: Duration) {
        let (open, ended) = &*self.reading;
        let open = open.lock().unwrap();
        let _ = ended.wait_timeout_while(open, limit, |open| *open > 0);
    }

    pub fn note(&self, what: impl Into<String>) -> Duration {
        let at = self.born.elapsed();
        self.events.lock().unwrap().push((at, what.into()));
        at
    }

    /// When the first event containing `needle` happened.
    pub fn when(&self, needle: &str) -> Option<Duration> {
        self.events
            .lock()
            .unwrap()
            .iter()
            .find(|(_, what)| what.contains(needle))
            .map(|(at, _)| *at)
    }

    pub fn text(&self) -> String {
        self.events
            .lock()
            .unwrap()
            .iter()
            .map(|(at, what)| format!("{:>8.3}s {what}", at.as_secs_f64()))
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn collect(&self, who: String, stream: impl Read + Send + 'static) {
        let timeline = self.clone();
        *self.reading.0.lock().unwrap() += 1;
        thread::spawn(move || {
            for line in BufReader::new(stream).lines() {
                let Ok(line) = line else { break };
                timeline.note(format!("[{who}] {line}"));
            }
            let (open, ended) = &*timeline.reading;
            *open.lock().unwrap() -= 1;
            ended.notify_all();
        });
    }
}

struct Running {
    name: String,
    spec: Value,
    /// `unshare`, whose status is the container's.
    child: Child,
    /// The container's init (PID 1 of its PID namespace), as this machine numbers it.
    init: u32,
    status: Option<ExitStatus>,
}

/// How a deletion went.
#[derive(Debug, Default)]
pub struct Deletion {
    /// preStop hook durations and statuses, by container.
    pub hooks: Vec<(String, Duration, Option<i32>)>,
    /// Exit time (from the deletion) and status of every container, in the order they exited.
    pub exits: Vec<(String, Duration, ExitStatus)>,
    /// Containers the kubelet had to SIGKILL at the end of the grace period.
    pub killed: Vec<String>,
    /// From the deletion to the last container's exit.
    pub took: Duration,
}

pub struct Pod {
    pub netns: Arc<NetNs>,
    pub timeline: Timeline,
    spec: Value,
    images: HashMap<String, Image>,
    volumes: HashMap<String, PathBuf>,
    dir: PathBuf,
    sidecars: Vec<Running>,
    apps: Vec<Running>,
    /// `status.podIP`.
    ip: String,
}

impl Pod {
    /// Creates the pod's sandbox (network namespace, volumes) for `spec`, a pod spec.
    pub fn new(
        tag: &str,
        spec: Value,
        images: HashMap<String, Image>,
    ) -> Result<Pod, &'static str> {
        let netns =
            NetNs::new(tag).ok_or("cannot make a network namespace (needs root and ip(8))")?;
        let dir = std::env::temp_dir().join(format!("lameduck-pod-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut volumes = HashMap::new();
        for volume in spec["volumes"].as_array().into_iter().flatten() {
            let name = volume["name"].as_str().unwrap().to_string();
            assert!(
                volume.get("emptyDir").is_some(),
                "only emptyDir volumes: {volume}"
            );
            let path = dir.join(&name);
            std::fs::create_dir_all(&path).unwrap();
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777)).unwrap();
            volumes.insert(name, path);
        }
        Ok(Pod {
            netns: Arc::new(netns),
            timeline: Timeline::new(),
            spec,
            images,
            volumes,
            dir,
            sidecars: Vec::new(),
            apps: Vec::new(),
            ip: "127.0.0.1".into(),
        })
    }

    /// The pod's address, as the downward API gives it (`status.podIP`); before `start`.
    pub fn set_ip(&mut self, ip: std::net::Ipv4Addr) {
        self.ip = ip.to_string();
    }

    /// Adds an environment variable to a container of the spec (before `start`).
    pub fn add_env(&mut self, container: &str, name: &str, value: &str) {
        for list in ["initContainers", "containers"] {
            for entry in self.spec[list].as_array_mut().into_iter().flatten() {
                if entry["name"] == container {
                    if entry.get("env").is_none() {
                        entry["env"] = serde_json::json!([]);
                    }
                    let env = entry["env"].as_array_mut().unwrap();
                    env.push(serde_json::json!({"name": name, "value": value}));
                }
            }
        }
    }

    pub fn grace(&self) -> Duration {
        Duration::from_secs(
            self.spec["terminationGracePeriodSeconds"]
                .as_u64()
                .unwrap_or(30),
        )
    }

    /// Where a container's termination message is (made, writable by any user, on first ask).
    fn termination_message_file(&self, container: &Value) -> PathBuf {
        let file = self.dir.join(format!(
            "{}.termination-log",
            container["name"].as_str().unwrap_or("?")
        ));
        if !file.exists() {
            use std::os::unix::fs::PermissionsExt;
            std::fs::write(&file, "").unwrap();
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o666)).unwrap();
        }
        file
    }

    /// What `kubectl describe pod` would show as the container's termination message.
    pub fn termination_message(&self, container: &str) -> String {
        let file = self.dir.join(format!("{container}.termination-log"));
        std::fs::read_to_string(file).unwrap_or_default()
    }

    /// A path as the container sees it, translated to where it is on this machine.
    fn translate(&self, container: &Value, value: &str) -> String {
        for mount in container["volumeMounts"].as_array().into_iter().flatten() {
            let at = mount["mountPath"].as_str().unwrap();
            if let Some(rest) = value.strip_prefix(at)
                && (rest.is_empty() || rest.starts_with('/'))
            {
                let volume = &self.volumes[mount["name"].as_str().unwrap()];
                return format!("{}{rest}", volume.display());
            }
        }
        // The kubelet bind-mounts a file of the container's own at its termination message
        // path, and reads it once the container has exited.
        if value == TERMINATION_MESSAGE_PATH {
            return self
                .termination_message_file(container)
                .display()
                .to_string();
        }
        let image = &self.images[container["image"].as_str().unwrap()];
        for (path, file) in &image.files {
            if value == path {
                return file.display().to_string();
            }
        }
        value.to_string()
    }

    /// A process of `container` running `argv` (as the container sees it): the container's
    /// init in a PID namespace of its own (`init` None), or a hook's process in the PID
    /// namespace of the container whose init is `init`, as a runtime's exec does. The user
    /// and no_new_privs come from the container's securityContext (setpriv).
    fn command(&self, container: &Value, argv: &[String], init: Option<u32>) -> Command {
        let security = &container["securityContext"];
        let uid = security["runAsUser"].as_u64();
        let gid = security["runAsGroup"].as_u64().or(uid);
        let no_new_privs = security["allowPrivilegeEscalation"] == false;
        let drop_all = security["capabilities"]["drop"]
            .as_array()
            .is_some_and(|drop| drop.iter().any(|cap| cap == "ALL"));
        // `add` after `drop: [ALL]`: only these stay (as `net_admin`, setpriv's spelling).
        let added: Vec<String> = security["capabilities"]["add"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|cap| cap.as_str())
            .map(|cap| format!(",+{}", cap.to_ascii_lowercase()))
            .collect();
        let read_only = security["readOnlyRootFilesystem"] == true;
        let mut wrapped: Vec<String> = match init {
            None => {
                let mut unshare: Vec<String> = ["unshare", "--pid", "--fork", "--kill-child"]
                    .map(String::from)
                    .to_vec();
                if read_only {
                    // The volumes the container mounts read-write stay so (a bind mount of
                    // their own); the rest of the root, read-only volumes included, is not.
                    let mut script = String::new();
                    for mount in container["volumeMounts"].as_array().into_iter().flatten() {
                        if mount["readOnly"] != true {
                            let dir = self.volumes[mount["name"].as_str().unwrap()].display();
                            script.push_str(&format!("mount --bind '{dir}' '{dir}' && "));
                        }
                    }
                    // So does its termination message (the kubelet's mount of it).
                    let message = self.termination_message_file(container);
                    let message = message.display();
                    script.push_str(&format!("mount --bind '{message}' '{message}' && "));
                    script.push_str("mount -o remount,bind,ro / && exec \"$0\" \"$@\"");
                    unshare.extend(["--mount", "--", "sh", "-c"].map(String::from));
                    unshare.push(script);
                } else {
                    unshare.push("--".into());
                }
                unshare
            }
            Some(pid) => {
                let mut nsenter = vec!["nsenter".into(), format!("--target={pid}"), "--pid".into()];
                if read_only {
                    nsenter.push("--mount".into());
                }
                nsenter.push("--".into());
                nsenter
            }
        };
        if uid.is_some() || no_new_privs || drop_all {
            wrapped.push("setpriv".into());
            if let (Some(uid), Some(gid)) = (uid, gid) {
                wrapped.push(format!("--reuid={uid}"));
                wrapped.push(format!("--regid={gid}"));
                wrapped.push("--clear-groups".into());
            }
            if drop_all {
                wrapped.push("--inh-caps=-all".into());
                wrapped.push(format!("--bounding-set=-all{}", added.concat()));
            }
            if no_new_privs {
                wrapped.push("--no-new-privs".into());
            }
            wrapped.push("--".into());
        }
        wrapped.extend(argv.iter().map(|arg| self.translate(container, arg)));
        let mut command = Command::new(&wrapped[0]);
        command.args(&wrapped[1..]).env_clear().env(
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        );
        for var in container["env"].as_array().into_iter().flatten() {
            // The downward API: the node's address (the kubelet's probes come from it).
            let value = match var.pointer("/valueFrom/fieldRef/fieldPath") {
                Some(path) if path == "status.hostIP" => HOST_IP,
                Some(path) if path == "status.podIP" => self.ip.as_str(),
                Some(path) => panic!("no downward API field {path} here"),
                None => var["value"].as_str().expect("a value or a fieldRef"),
            };
            command.env(
                var["name"].as_str().unwrap(),
                self.translate(container, value),
            );
        }
        let netns = self.netns.raw_fd();
        // SAFETY: setns(2) is async-signal-safe.
        unsafe {
            command.pre_exec(move || {
                if libc::setns(netns, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        command
    }

    fn start_container(&self, container: &Value) -> Running {
        let name = container["name"].as_str().unwrap().to_string();
        let image = &self.images[container["image"].as_str().unwrap()];
        let strings = |key: &str| -> Option<Vec<String>> {
            container[key].as_array().map(|items| {
                items
                    .iter()
                    .map(|item| item.as_str().unwrap().to_string())
                    .collect()
            })
        };
        let mut argv = strings("command").unwrap_or_else(|| image.entrypoint.clone());
        argv.extend(strings("args").unwrap_or_default());
        let mut child = self
            .command(container, &argv, None)
            .spawn()
            .unwrap_or_else(|error| panic!("start container {name} ({argv:?}): {error}"));
        let init = init_of(child.id());
        self.timeline.note(format!(
            "kubelet: started container {name} (init pid {init})"
        ));
        self.timeline
            .collect(name.clone(), child.stdout.take().unwrap());
        self.timeline
            .collect(name.clone(), child.stderr.take().unwrap());
        if container["securityContext"]["readOnlyRootFilesystem"] == true {
            self.wait_for_read_only_root(&name, init);
        }
        Running {
            name,
            spec: container.clone(),
            child,
            init,
            status: None,
        }
    }

    /// A runtime sets a container's mounts up before its process starts; here the container's
    /// init does it first ([`Pod::command`]'s script), so the container counts as started only
    /// once its root is read-only (or it has already exited: its status tells the rest). A hook
    /// that entered its mount namespace earlier could hold the root for writing for a moment
    /// (creating a file, or an atime update as it execs) and make the remount fail with "mount
    /// point is busy": the container died at its start.
    fn wait_for_read_only_root(&self, name: &str, init: u32) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            // /proc/PID/mountinfo: "ID PARENT MAJ:MIN ROOT MOUNT-POINT OPTIONS ..."; the last
            // mount on "/" is the one the container sees. Empty or gone once it has exited.
            let mounts =
                std::fs::read_to_string(format!("/proc/{init}/mountinfo")).unwrap_or_default();
            let root = mounts
                .lines()
                .rev()
                .map(|line| line.split(' ').collect::<Vec<_>>())
                .find(|fields| fields.get(4) == Some(&"/"));
            let Some(root) = root else { return };
            if root
                .get(5)
                .is_some_and(|options| options.split(',').any(|o| o == "ro"))
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "container {name} did not set its read-only root up:\n{}",
                self.timeline.text()
            );
            thread::sleep(Duration::from_millis(1));
        }
    }

    /// Runs a lifecycle hook's exec command in `container`, until it ends or `deadline`;
    /// returns its exit code (None: not an exec hook, or killed at the deadline).
    fn run_hook(
        &self,
        container: &Value,
        init: u32,
        event: &str,
        deadline: Instant,
    ) -> Option<i32> {
        let name = container["name"].as_str().unwrap();
        if let Some(get) = container["lifecycle"][event]["httpGet"].as_object() {
            // The kubelet's GET to the container's port (on the pod's address; here its
            // loopback, which the pod's NAT rules leave alone as they leave the node's).
            let port = self.port(container, &get["port"]);
            let path = get["path"].as_str().unwrap_or("/").to_string();
            self.timeline.note(format!(
                "kubelet: {event} hook of {name}: GET {path} on port {port}"
            ));
            let patience = deadline.saturating_duration_since(Instant::now());
            let status = self
                .netns
                .run(move || http_status_within(port, &path, patience));
            self.timeline.note(format!(
                "kubelet: {event} hook of {name} ended: HTTP {status:?}"
            ));
            return None;
        }
        let command = container["lifecycle"][event]["exec"]["command"].as_array()?;
        let argv: Vec<String> = command
            .iter()
            .map(|arg| arg.as_str().unwrap().to_string())
            .collect();
        self.timeline
            .note(format!("kubelet: {event} hook of {name}: {argv:?}"));
        let mut child = self.command(container, &argv, Some(init)).spawn().unwrap();
        let who = format!("{name} {event}");
        self.timeline
            .collect(who.clone(), child.stdout.take().unwrap());
        self.timeline.collect(who, child.stderr.take().unwrap());
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                self.timeline
                    .note(format!("kubelet: {event} hook of {name} ended: {status}"));
                return status.code();
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                self.timeline.note(format!(
                    "kubelet: {event} hook of {name} killed at the deadline"
                ));
                return None;
            }
            thread::sleep(Duration::from_millis(5));
        }
    }

    /// Polls the container's startup probe (httpGet) until it passes; panics if it never does.
    fn wait_startup_probe(&self, container: &Value) {
        let probe = &container["startupProbe"];
        let Some(path) = probe["httpGet"]["path"].as_str() else {
            return;
        };
        let port = self.port(container, &probe["httpGet"]["port"]);
        let period = Duration::from_secs(probe["periodSeconds"].as_u64().unwrap_or(10));
        let failures = probe["failureThreshold"].as_u64().unwrap_or(3) as u32;
        let path = path.to_string();
        let name = container["name"].as_str().unwrap().to_string();
        let passed = self.netns.run(move || {
            for _ in 0..failures.max(1) {
                if http_status(port, &path) == Some(200) {
                    return true;
                }
                // A shorter first wait than the kubelet's: the tests' clock is precious, and
                // only the order matters here.
                thread::sleep(period.min(Duration::from_millis(100)));
            }
            false
        });
        assert!(
            passed,
            "startup probe of {name} never passed:\n{}",
            self.timeline.text()
        );
        self.timeline
            .note(format!("kubelet: startup probe of {name} passed"));
    }

    fn port(&self, container: &Value, port: &Value) -> u16 {
        if let Some(number) = port.as_u64() {
            return number as u16;
        }
        let name = port.as_str().unwrap();
        container["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["name"] == name)
            .and_then(|p| p["containerPort"].as_u64())
            .unwrap_or_else(|| panic!("no port named {name}")) as u16
    }

    /// Starts the pod: init containers in order (sidecars left running once started), then
    /// the app containers with their postStart hooks.
    pub fn start(&mut self) {
        let spec = self.spec.clone();
        for init in spec["initContainers"].as_array().into_iter().flatten() {
            let mut running = self.start_container(init);
            if init["restartPolicy"] == "Always" {
                self.wait_startup_probe(init);
                self.sidecars.push(running);
            } else {
                let status = running.child.wait().unwrap();
                self.timeline.note(format!(
                    "kubelet: init container {} ended: {status}",
                    running.name
                ));
                assert!(status.success(), "init container {} failed", running.name);
            }
        }
        for container in spec["containers"].as_array().into_iter().flatten() {
            let running = self.start_container(container);
            let far = Instant::now() + Duration::from_secs(60);
            let code = self.run_hook(container, running.init, "postStart", far);
            assert!(
                code.is_none_or(|code| code == 0),
                "postStart of {} failed (the kubelet would kill the container):\n{}",
                running.name,
                self.timeline.text()
            );
            self.apps.push(running);
        }
    }

    /// Deletes the pod as the kubelet does.
    pub fn delete(&mut self) -> Deletion {
        let started = Instant::now();
        let deadline = started + self.grace();
        self.timeline.note(format!(
            "kubelet: pod deleted (terminationGracePeriodSeconds {})",
            self.grace().as_secs()
        ));
        let mut deletion = Deletion::default();
        let apps = std::mem::take(&mut self.apps);
        let sidecars = std::mem::take(&mut self.sidecars);
        let this: &Pod = self;
        // Every container's preStop hook runs at once, a sidecar's too (kuberuntime's
        // killContainer runs it before the sidecar waits for its turn); the app containers
        // are signalled after their own.
        let (results, sidecar_hooks): (Vec<_>, Vec<_>) = thread::scope(|scope| {
            let sidecar_hooks: Vec<_> = sidecars
                .iter()
                .map(|running| scope.spawn(move || this.pre_stop(running, deadline)))
                .collect();
            let stops: Vec<_> = apps
                .into_iter()
                .map(|running| scope.spawn(move || this.stop(running, started, deadline)))
                .collect();
            (
                stops.into_iter().map(|stop| stop.join().unwrap()).collect(),
                sidecar_hooks
                    .into_iter()
                    .map(|hook| hook.join().unwrap())
                    .collect(),
            )
        });
        for (hook, exit, killed) in results {
            deletion.hooks.extend(hook);
            deletion.exits.push(exit);
            deletion.killed.extend(killed);
        }
        deletion.hooks.extend(sidecar_hooks.into_iter().flatten());
        for running in sidecars.into_iter().rev() {
            let (exit, killed) = this.terminate(running, started, deadline);
            deletion.exits.push(exit);
            deletion.killed.extend(killed);
        }
        deletion.took = started.elapsed();
        // Every container has exited: its last lines are on their way to the timeline.
        self.timeline.settle(Duration::from_secs(5));
        deletion
    }

    /// preStop, SIGTERM, wait; SIGKILL at the deadline.
    #[allow(clippy::type_complexity)]
    fn stop(
        &self,
        running: Running,
        started: Instant,
        deadline: Instant,
    ) -> (
        Option<(String, Duration, Option<i32>)>,
        (String, Duration, ExitStatus),
        Option<String>,
    ) {
        let hook = self.pre_stop(&running, deadline);
        let (exit, killed) = self.terminate(running, started, deadline);
        (hook, exit, killed)
    }

    /// The container's preStop hook (exec), if it has one: its name, how long it took, its
    /// exit code (`None`: killed at the deadline).
    fn pre_stop(
        &self,
        running: &Running,
        deadline: Instant,
    ) -> Option<(String, Duration, Option<i32>)> {
        let hook_started = Instant::now();
        self.run_hook(&running.spec, running.init, "preStop", deadline)
            .map(|code| (running.name.clone(), hook_started.elapsed(), Some(code)))
            .or_else(|| {
                running.spec["lifecycle"]["preStop"]["exec"]
                    .is_object()
                    .then(|| (running.name.clone(), hook_started.elapsed(), None))
            })
    }

    /// SIGTERM, wait; SIGKILL at the deadline.
    fn terminate(
        &self,
        mut running: Running,
        started: Instant,
        deadline: Instant,
    ) -> ((String, Duration, ExitStatus), Option<String>) {
        self.timeline
            .note(format!("kubelet: SIGTERM to {}", running.name));
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(running.init as i32, libc::SIGTERM) };
        let mut killed = None;
        let status = loop {
            if let Some(status) = running.child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() >= deadline {
                self.timeline.note(format!(
                    "kubelet: SIGKILL to {} (grace period over)",
                    running.name
                ));
                // SAFETY: kill(2); the init's end takes the whole PID namespace with it.
                unsafe { libc::kill(running.init as i32, libc::SIGKILL) };
                let _ = running.child.kill();
                killed = Some(running.name.clone());
                break running.child.wait().unwrap();
            }
            thread::sleep(Duration::from_millis(2));
        };
        running.status = Some(status);
        self.timeline.note(format!(
            "kubelet: container {} exited: {status}",
            running.name
        ));
        ((running.name, started.elapsed(), status), killed)
    }

    /// Runs `argv` in a running app container, as `kubectl exec` does: its exit code and
    /// output.
    pub fn exec(&self, name: &str, argv: &[&str]) -> (Option<i32>, String) {
        let running = self
            .apps
            .iter()
            .find(|running| running.name == name)
            .unwrap_or_else(|| panic!("no app container {name}"));
        let argv: Vec<String> = argv.iter().map(|arg| arg.to_string()).collect();
        let output = self
            .command(&running.spec, &argv, Some(running.init))
            .output()
            .unwrap();
        let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
        text.push_str(&String::from_utf8_lossy(&output.stderr));
        (output.status.code(), text)
    }

    /// Restarts one app container as after a failed liveness probe: preStop, SIGTERM, wait,
    /// then start it again with its postStart hook.
    pub fn restart(&mut self, name: &str) -> Option<i32> {
        let at = self
            .apps
            .iter()
            .position(|running| running.name == name)
            .unwrap_or_else(|| panic!("no app container {name}"));
        let running = self.apps.remove(at);
        let spec = running.spec.clone();
        self.timeline.note(format!(
            "kubelet: liveness probe of {name} failed: restarting it"
        ));
        let deadline = Instant::now() + self.grace();
        let (hook, _, _) = self.stop(running, Instant::now(), deadline);
        let restarted = self.start_container(&spec);
        let code = self.run_hook(
            &spec,
            restarted.init,
            "postStart",
            Instant::now() + Duration::from_secs(60),
        );
        assert!(code.is_none_or(|code| code == 0), "postStart failed");
        self.apps.insert(at, restarted);
        hook.and_then(|(_, _, code)| code)
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        for running in self.apps.iter_mut().chain(self.sidecars.iter_mut()) {
            // The container's init first, while `unshare` still holds it (so the pid is
            // still its): a process that changed its user (the proxy, under setpriv) lost
            // unshare's --kill-child on the way, and would outlive the test.
            if let Ok(None) = running.child.try_wait() {
                // SAFETY: kill(2) with a pid and a signal number; no memory is involved.
                unsafe { libc::kill(running.init as i32, libc::SIGKILL) };
            }
            let _ = running.child.kill();
            let _ = running.child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The child that `unshare --fork` (pid `unshare`) started: the container's init.
fn init_of(unshare: u32) -> u32 {
    let children = format!("/proc/{unshare}/task/{unshare}/children");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let found = std::fs::read_to_string(&children).unwrap_or_default();
        if let Some(pid) = found.split_whitespace().next() {
            return pid.parse().unwrap();
        }
        assert!(
            Instant::now() < deadline,
            "unshare {unshare} started no child"
        );
        thread::sleep(Duration::from_millis(1));
    }
}

/// `GET path` on 127.0.0.1:`port` of the calling thread's network namespace.
pub fn http_status(port: u16, path: &str) -> Option<u16> {
    http_status_within(port, path, Duration::from_secs(2))
}

/// [`http_status`], waiting at most `patience` for the answer.
fn http_status_within(port: u16, path: &str, patience: Duration) -> Option<u16> {
    let mut stream =
        TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_secs(1)).ok()?;
    stream.set_read_timeout(Some(patience)).ok()?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .ok()?;
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).ok()?;
    std::str::from_utf8(&head[9..12]).ok()?.parse().ok()
}

/// The kubelet's readiness probes of a running pod's containers, sent from wherever the
/// calling test puts them (the node's address on the pod network: the bridge's), to the pod's
/// address, every `periodSeconds`, each waiting `timeoutSeconds`: `httpGet` (a status from 200
/// to 399 passes, with the kubelet's `User-Agent`) and `tcpSocket` (a connection that opens
/// passes). Counts what passed and what failed, until dropped.
pub struct Probes {
    stop: Arc<std::sync::atomic::AtomicBool>,
    passed: Arc<std::sync::atomic::AtomicU64>,
    failed: Arc<std::sync::atomic::AtomicU64>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Probes {
    /// Probes `pod`'s containers at `ip` from `from`'s network namespace.
    pub fn start(pod: &Pod, from: &Arc<NetNs>, ip: std::net::Ipv4Addr) -> Probes {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        let mut probes = Vec::new();
        for container in pod.spec["containers"].as_array().into_iter().flatten() {
            let probe = &container["readinessProbe"];
            let period = Duration::from_secs(probe["periodSeconds"].as_u64().unwrap_or(10));
            let timeout = Duration::from_secs(probe["timeoutSeconds"].as_u64().unwrap_or(1));
            let action = if let Some(get) = probe["httpGet"].as_object() {
                let port = pod.port(container, &get["port"]);
                let path = get["path"].as_str().unwrap_or("/").to_string();
                Some((port, Some(path)))
            } else {
                probe["tcpSocket"]
                    .as_object()
                    .map(|tcp| (pod.port(container, &tcp["port"]), None))
            };
            if let Some((port, path)) = action {
                probes.push((
                    period,
                    timeout,
                    std::net::SocketAddr::from((ip, port)),
                    path,
                ));
            }
        }
        let stop = Arc::new(AtomicBool::new(false));
        let (passed, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let thread = {
            let (stop, passed, failed) = (stop.clone(), passed.clone(), failed.clone());
            from.spawn(move || {
                let started = Instant::now();
                let mut next: Vec<Instant> = probes.iter().map(|_| started).collect();
                while !stop.load(Ordering::SeqCst) {
                    for ((period, timeout, addr, path), due) in probes.iter().zip(next.iter_mut()) {
                        if Instant::now() < *due {
                            continue;
                        }
                        *due += *period;
                        let ok = match path {
                            Some(path) => probe_http(*addr, path, *timeout),
                            None => TcpStream::connect_timeout(addr, *timeout).is_ok(),
                        };
                        let counter = if ok { &passed } else { &failed };
                        counter.fetch_add(1, Ordering::SeqCst);
                    }
                    thread::sleep(Duration::from_millis(20));
                }
            })
        };
        Probes {
            stop,
            passed,
            failed,
            thread: Some(thread),
        }
    }

    /// Probes that passed and failed so far.
    pub fn counts(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering;
        (
            self.passed.load(Ordering::SeqCst),
            self.failed.load(Ordering::SeqCst),
        )
    }
}

impl Drop for Probes {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// An HTTP probe as the kubelet sends it, waiting `timeout`.
fn probe_http(addr: std::net::SocketAddr, path: &str, timeout: Duration) -> bool {
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, timeout) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(timeout));
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nUser-Agent: kube-probe/1.33\r\nAccept: */*\r\nConnection: close\r\n\r\n"
    );
    let mut head = [0u8; 12];
    if stream.write_all(request.as_bytes()).is_err() || stream.read_exact(&mut head).is_err() {
        return false;
    }
    std::str::from_utf8(&head[9..12])
        .ok()
        .and_then(|status| status.parse::<u16>().ok())
        .is_some_and(|status| (200..400).contains(&status))
}
