//! Where `tandem up` puts its workers, and whether `--transport` can move KV between them. Pure:
//! decided from the flags alone before any child starts, and tested without one.
//!
//! `--device` sets the device of every worker; `--prefill-device` and `--decode-device` win over
//! it for their role. Each takes one device (`cpu`, `cuda:N`, parsed as the workers parse
//! `--device`) or a comma list of them, dealt round-robin to the workers of the role in start
//! order: `--prefill-device cuda:0,cuda:1` with three prefill workers puts them on cuda:0,
//! cuda:1, cuda:0. Colocated workers take the decode devices. A role without any device runs on
//! the workers' default, the CPU, and every worker is told its device explicitly, so what
//! `tandem up` prints is what the worker runs on.

use std::fmt;
use std::str::FromStr;

use tandem_engine::Device;
/// `--transport`: the workers' own flag type, so `tandem up` accepts exactly what they take.
pub(crate) use tandem_worker::TransportChoice as Transport;

/// One flag's devices: a device or a comma list of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DeviceList(Vec<Device>);

impl FromStr for DeviceList {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let mut devices = Vec::new();
        for item in s.split(',') {
            if item.trim().is_empty() {
                return Err(format!("empty device in {s:?} (expected cpu, cuda:N or a comma list of them)"));
            }
            devices.push(item.parse::<Device>()?);
        }
        Ok(DeviceList(devices))
    }
}

impl fmt::Display for DeviceList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<String> = self.0.iter().map(Device::to_string).collect();
        f.write_str(&names.join(","))
    }
}

/// A worker's role in `tandem up`; its name starts the worker's id (`prefill-0`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    Prefill,
    Decode,
    Colocated,
}

impl Role {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Colocated => "colocated",
        }
    }
}

/// The device flags of `tandem up`.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct DeviceFlags<'a> {
    /// `--device`: every role.
    pub(crate) device: Option<&'a DeviceList>,
    /// `--prefill-device`.
    pub(crate) prefill: Option<&'a DeviceList>,
    /// `--decode-device` (also the colocated workers').
    pub(crate) decode: Option<&'a DeviceList>,
}

/// The device of every worker `tandem up` starts, role by role in start order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Placement {
    /// Each role with its workers' devices (worker `i` of the role is `devices[i]`).
    pub(crate) roles: Vec<(Role, Vec<Device>)>,
}

impl Placement {
    /// Deals the devices to `prefill_workers` prefill and `decode_workers` decode workers, or,
    /// `colocated`, to `decode_workers` colocated workers.
    pub(crate) fn new(
        flags: DeviceFlags<'_>,
        colocated: bool,
        prefill_workers: u32,
        decode_workers: u32,
    ) -> Placement {
        let deal = |list: Option<&DeviceList>, n: u32| -> Vec<Device> {
            let list = list.or(flags.device).map(|l| l.0.as_slice()).unwrap_or(&[Device::Cpu]);
            (0..n as usize).map(|i| list[i % list.len()]).collect()
        };
        let roles = if colocated {
            vec![(Role::Colocated, deal(flags.decode, decode_workers))]
        } else {
            vec![
                (Role::Prefill, deal(flags.prefill, prefill_workers)),
                (Role::Decode, deal(flags.decode, decode_workers)),
            ]
        };
        Placement { roles }
    }

    /// Refuses a transport that cannot move KV between these workers: the GPU transports with a
    /// worker on the CPU, and NCCL with a prefill and a decode worker on one GPU (NCCL allows one
    /// rank per GPU).
    pub(crate) fn check_transport(&self, t: Transport) -> Result<(), String> {
        if t.needs_gpus() {
            for (role, devices) in &self.roles {
                let on_cpu: Vec<usize> = (0..devices.len()).filter(|&i| devices[i] == Device::Cpu).collect();
                let Some(&first) = on_cpu.first() else { continue };
                let who = match (on_cpu.len() == devices.len(), devices.len()) {
                    (true, 1) => format!("the {} worker is on cpu", role.name()),
                    (true, _) => format!("the {} workers are on cpu", role.name()),
                    (false, _) => format!("{}-{first} is on cpu", role.name()),
                };
                let give = match role {
                    Role::Colocated => "--decode-device",
                    _ => "--prefill-device/--decode-device",
                };
                return Err(format!("--transport {t} moves KV between GPUs, but {who}; give {give} cuda:N"));
            }
        }
        if t == Transport::Nccl {
            let of = |want: Role| {
                self.roles.iter().filter(move |(r, _)| *r == want).flat_map(|(_, d)| d.iter().copied())
            };
            let decode: Vec<Device> = of(Role::Decode).collect();
            if let Some(gpu) = of(Role::Prefill).find(|d| decode.contains(d)) {
                return Err(format!(
                    "NCCL cannot put two ranks on one GPU ({gpu}): give the decode workers another GPU or use \
                     --transport cuda-ipc"
                ));
            }
        }
        Ok(())
    }

    /// `prefill-0 on cuda:0, decode-0 on cuda:1`: every worker's id and device, for the lines
    /// `tandem up` prints.
    pub(crate) fn summary(&self) -> String {
        let mut parts = Vec::new();
        for (role, devices) in &self.roles {
            for (i, d) in devices.iter().enumerate() {
                parts.push(format!("{}-{i} on {d}", role.name()));
            }
        }
        parts.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(s: &str) -> DeviceList {
        s.parse().unwrap_or_else(|e| panic!("{s:?}: {e}"))
    }

    fn place(
        device: Option<&str>,
        prefill: Option<&str>,
        decode: Option<&str>,
        colocated: bool,
        n: (u32, u32),
    ) -> Placement {
        let (device, prefill, decode) = (device.map(list), prefill.map(list), decode.map(list));
        let flags =
            DeviceFlags { device: device.as_ref(), prefill: prefill.as_ref(), decode: decode.as_ref() };
        Placement::new(flags, colocated, n.0, n.1)
    }

    fn devices(p: &Placement, role: Role) -> Vec<String> {
        let (_, d) = p.roles.iter().find(|(r, _)| *r == role).expect("role placed");
        d.iter().map(Device::to_string).collect()
    }

    #[test]
    fn device_lists_parse_with_the_workers_parser() {
        assert_eq!(list("cpu").0, [Device::Cpu]);
        assert_eq!(list("cuda:0,cuda:1").0, [Device::Cuda(0), Device::Cuda(1)]);
        assert_eq!(list(" cuda:1 , cpu").0, [Device::Cuda(1), Device::Cpu]);
        assert_eq!(list("cuda:0,cuda:1").to_string(), "cuda:0,cuda:1");
        for (bad, says) in [
            ("gpu", "unknown device"),
            ("cuda:x", "invalid CUDA ordinal"),
            ("cuda:", "invalid CUDA ordinal"),
            ("", "empty device"),
            ("cuda:0,", "empty device"),
            ("cuda:0,,cuda:1", "empty device"),
        ] {
            let e = bad.parse::<DeviceList>().expect_err(bad);
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }

    #[test]
    fn a_role_s_own_flag_wins_over_device_and_lists_go_round_robin() {
        // Nothing given: every worker on the CPU.
        let p = place(None, None, None, false, (1, 2));
        assert_eq!(devices(&p, Role::Prefill), ["cpu"]);
        assert_eq!(devices(&p, Role::Decode), ["cpu", "cpu"]);
        // --device sets both roles.
        let p = place(Some("cuda:0"), None, None, false, (1, 1));
        assert_eq!(
            (devices(&p, Role::Prefill), devices(&p, Role::Decode)),
            (vec!["cuda:0".into()], vec!["cuda:0".into()])
        );
        // A role's flag overrides --device for that role only.
        let p = place(Some("cuda:2"), None, Some("cuda:1"), false, (1, 1));
        assert_eq!(devices(&p, Role::Prefill), ["cuda:2"]);
        assert_eq!(devices(&p, Role::Decode), ["cuda:1"]);
        let p = place(None, Some("cuda:0"), Some("cuda:1"), false, (1, 1));
        assert_eq!(p.summary(), "prefill-0 on cuda:0, decode-0 on cuda:1");
        // Lists are dealt round-robin, in start order.
        let p = place(None, Some("cuda:0,cuda:1"), Some("cuda:2,cuda:3"), false, (3, 1));
        assert_eq!(devices(&p, Role::Prefill), ["cuda:0", "cuda:1", "cuda:0"]);
        assert_eq!(devices(&p, Role::Decode), ["cuda:2"]);
        // Colocated workers take the decode devices; there is no prefill role.
        let p = place(Some("cpu"), None, Some("cuda:0,cuda:1"), true, (1, 2));
        assert_eq!(p.roles.len(), 1);
        assert_eq!(devices(&p, Role::Colocated), ["cuda:0", "cuda:1"]);
        assert_eq!(p.summary(), "colocated-0 on cuda:0, colocated-1 on cuda:1");
    }

    #[test]
    fn gpu_transports_are_refused_with_a_worker_on_the_cpu() {
        let two_gpus = place(None, Some("cuda:0"), Some("cuda:1"), false, (1, 1));
        for t in [
            Transport::Auto,
            Transport::Shm,
            Transport::Tcp,
            Transport::CudaIpc,
            Transport::Nccl,
            Transport::Nixl,
        ] {
            assert_eq!(two_gpus.check_transport(t), Ok(()), "{t}");
        }
        // The CPU transports (nixl moves host pools) never depend on the devices.
        let cpu = place(None, None, None, false, (2, 2));
        for t in [Transport::Auto, Transport::Shm, Transport::Tcp, Transport::Nixl] {
            assert_eq!(cpu.check_transport(t), Ok(()), "{t}");
        }
        let e = cpu.check_transport(Transport::CudaIpc).unwrap_err();
        assert_eq!(
            e,
            "--transport cuda-ipc moves KV between GPUs, but the prefill workers are on cpu; give \
             --prefill-device/--decode-device cuda:N"
        );
        // The role and the device are named, whichever role is on the CPU.
        let e =
            place(None, Some("cuda:0"), None, false, (1, 1)).check_transport(Transport::Nccl).unwrap_err();
        assert!(
            e.starts_with("--transport nccl moves KV between GPUs, but the decode worker is on cpu;"),
            "{e}"
        );
        // One worker of several on the CPU is named by its id.
        let e = place(None, Some("cuda:0"), Some("cuda:1,cpu"), false, (1, 2))
            .check_transport(Transport::CudaIpc)
            .unwrap_err();
        assert!(e.contains("but decode-1 is on cpu"), "{e}");
        // Colocated workers have one flag to fix it.
        let e = place(None, None, None, true, (1, 1)).check_transport(Transport::CudaIpc).unwrap_err();
        assert!(e.contains("the colocated worker is on cpu; give --decode-device cuda:N"), "{e}");
    }

    #[test]
    fn nccl_is_refused_with_prefill_and_decode_on_one_gpu() {
        let shared = place(Some("cuda:0"), None, None, false, (1, 1));
        assert_eq!(
            shared.check_transport(Transport::Nccl).unwrap_err(),
            "NCCL cannot put two ranks on one GPU (cuda:0): give the decode workers another GPU or use \
             --transport cuda-ipc"
        );
        // CUDA IPC can share a GPU.
        assert_eq!(shared.check_transport(Transport::CudaIpc), Ok(()));
        // Only the devices workers are dealt count: one prefill worker takes cuda:0 only.
        let p = place(None, Some("cuda:0,cuda:1"), Some("cuda:1"), false, (1, 1));
        assert_eq!(p.check_transport(Transport::Nccl), Ok(()));
        let p = place(None, Some("cuda:0,cuda:1"), Some("cuda:1"), false, (2, 1));
        assert!(p.check_transport(Transport::Nccl).unwrap_err().contains("(cuda:1)"));
        // Colocated workers exchange no KV between roles.
        let p = place(Some("cuda:0"), None, None, true, (1, 2));
        assert_eq!(p.check_transport(Transport::Nccl), Ok(()));
    }

    #[test]
    fn transport_names_are_the_workers_flag_values() {
        use clap::ValueEnum;
        for t in Transport::value_variants() {
            let pv = t.to_possible_value().expect("every variant is a value");
            assert_eq!(pv.get_name(), t.name());
            assert_eq!(Transport::from_str(t.name(), false), Ok(*t));
        }
        assert!(Transport::from_str("rdma", false).is_err());
    }
}
