//! Network namespaces for the tests and benchmarks that need a network of their own (root and
//! iproute2): only addresses inside the namespaces made here are used, none has a default
//! route, and each is deleted when its [`Namespaces`] drops (stale ones of a killed run, found
//! by their prefix, before new ones are made).

use std::process::Command;

/// `ip ARGS` in this process's namespace.
pub fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip").args(args).output()?;
    anyhow::ensure!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// `cmd` run inside namespace `ns`; its standard output.
pub fn in_ns(ns: &str, cmd: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("ip")
        .args(["netns", "exec", ns])
        .args(cmd)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "in {ns}: {}: {}",
        cmd.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Why `what` cannot build namespaces here (not root, no iproute2), if it cannot.
pub fn check_available(what: &str) -> anyhow::Result<()> {
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0\n"));
    anyhow::ensure!(root, "{what} needs root (network namespaces, veth)");
    ip(&["netns", "list"])
        .map_err(|e| anyhow::anyhow!("{what}: network namespaces are not available here: {e}"))
}

/// Namespaces named `prefix` + a name, deleted on drop (deleting a namespace deletes its veth
/// ends, and their peers with them).
pub struct Namespaces {
    prefix: String,
    made: Vec<String>,
}

impl Namespaces {
    /// None made yet; any left by a killed run with this prefix are deleted.
    pub fn new(prefix: &str) -> Namespaces {
        let listed = Command::new("ip").args(["netns", "list"]).output();
        let stale: Vec<String> = listed
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .filter_map(|l| l.split_whitespace().next())
                    .filter(|n| n.starts_with(prefix))
                    .map(String::from)
                    .collect()
            })
            .unwrap_or_default();
        for ns in stale {
            let _ = ip(&["netns", "del", &ns]);
        }
        Namespaces {
            prefix: prefix.into(),
            made: Vec::new(),
        }
    }

    /// Makes namespace `prefix + name`, its loopback up; its full name.
    pub fn add(&mut self, name: &str) -> anyhow::Result<String> {
        let ns = format!("{}{name}", self.prefix);
        ip(&["netns", "add", &ns])?;
        self.made.push(ns.clone());
        in_ns(&ns, &["ip", "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// A veth pair between two namespaces made here, both ends up: `a_dev` in `a` and `b_dev`
    /// in `b`, each with its address (`10.78.0.1/30`) where one is given.
    pub fn veth(
        &self,
        a: (&str, &str, Option<&str>),
        b: (&str, &str, Option<&str>),
    ) -> anyhow::Result<()> {
        ip(&["link", "add", a.1, "type", "veth", "peer", "name", b.1])?;
        for (ns, dev, cidr) in [a, b] {
            ip(&["link", "set", dev, "netns", ns])?;
            if let Some(cidr) = cidr {
                in_ns(ns, &["ip", "addr", "add", cidr, "dev", dev])?;
            }
            in_ns(ns, &["ip", "link", "set", dev, "up"])?;
        }
        Ok(())
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for ns in &self.made {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}
