//! Where late connections go (`--handoff`, `LAMEDUCK_HANDOFF`): hand-off to the pod's Service.
//!
//! Once a pod's lame duck is over, what the cluster still sends it is late. With a hand-off
//! for the port a late connection addressed, the proxy forwards it to that Service (its other
//! pods, through the node's Service rules) instead of refusing it (docs/pod-lifecycle.md,
//! "Hand-off"). Each entry is `PORT=HOST:PORT`: the pod port the Service's `targetPort` names
//! (the port clients reach the pod on: the app's port under interception, the listener's port
//! otherwise), and the Service's address, a cluster DNS name or an IP, with its port. Entries
//! are comma-separated; `lameduck inject` writes them from the Services in its stream.

use super::{Target, parse_target};

/// The hand-off of each pod port that has one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Handoffs(Vec<(u16, Target)>);

impl Handoffs {
    /// Reads `8080=web.shop.svc.cluster.local:80,9090=10.96.0.12:9090`.
    pub fn parse(value: &str) -> Result<Handoffs, String> {
        let mut entries: Vec<(u16, Target)> = Vec::new();
        for entry in value
            .split(',')
            .map(str::trim)
            .filter(|entry| !entry.is_empty())
        {
            let Some((port, to)) = entry.split_once('=') else {
                return Err(format!("{entry:?} is not PORT=HOST:PORT"));
            };
            let port = match port.trim().parse::<u16>() {
                Ok(port) if port != 0 => port,
                _ => return Err(format!("{entry:?}: the pod port must be 1 to 65535")),
            };
            let target = match parse_target(to.trim()) {
                Ok(Target::OrigDst) | Err(_) => {
                    return Err(format!(
                        "{entry:?}: the Service must be HOST:PORT or IP:PORT"
                    ));
                }
                Ok(target) => target,
            };
            if entries.iter().any(|(known, _)| *known == port) {
                return Err(format!("pod port {port} is handed off twice"));
            }
            entries.push((port, target));
        }
        Ok(Handoffs(entries))
    }

    /// Where a late connection to pod port `port` goes, if anywhere.
    pub fn to(&self, port: u16) -> Option<&Target> {
        self.0
            .iter()
            .find(|(known, _)| *known == port)
            .map(|(_, target)| target)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = &(u16, Target)> {
        self.0.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handoffs_parse_names_and_addresses() {
        let handoffs =
            Handoffs::parse(" 8080=web.shop.svc.cluster.local:80 , 9090=10.96.0.12:9090,").unwrap();
        assert_eq!(
            handoffs.to(8080),
            Some(&Target::Host {
                host: "web.shop.svc.cluster.local".into(),
                port: 80
            })
        );
        assert_eq!(
            handoffs.to(9090),
            Some(&Target::Addr("10.96.0.12:9090".parse().unwrap()))
        );
        assert_eq!(handoffs.to(80), None);
        assert!(Handoffs::parse("").unwrap().is_empty());
    }

    #[test]
    fn bad_handoffs_say_what_is_wrong() {
        for (value, says) in [
            ("8080", "is not PORT=HOST:PORT"),
            ("0=web:80", "1 to 65535"),
            ("http=web:80", "1 to 65535"),
            ("8080=web", "HOST:PORT"),
            ("8080=orig-dst", "HOST:PORT"),
            ("8080=web:0", "HOST:PORT"),
            ("8080=a:80,8080=b:80", "twice"),
        ] {
            let error = Handoffs::parse(value).unwrap_err();
            assert!(error.contains(says), "{value}: {error}");
        }
    }
}
