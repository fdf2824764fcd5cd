//! Which IP addresses a request made on a tenant's behalf may reach: [`is_public`], the one rule
//! the gateway's webhooks use (and the egress proxy to come is to use), written from the IANA
//! registries rather than from the standard library's partial predicates.
//!
//! Sources (the tables below copy every entry, with its "Globally Reachable" flag):
//! - IANA IPv4 Special-Purpose Address Registry,
//!   <https://www.iana.org/assignments/iana-ipv4-special-registry> (RFC 6890, RFC 8190);
//! - IANA IPv6 Special-Purpose Address Registry,
//!   <https://www.iana.org/assignments/iana-ipv6-special-registry> (RFC 6890, RFC 8190; the
//!   version of 2025-10-09);
//! - for what those registries do not list: the IPv4 and IPv6 multicast spaces (RFC 5771,
//!   RFC 4291 §2.7), the IPv6 Address Space registry
//!   (<https://www.iana.org/assignments/ipv6-address-space>: only `2000::/3` is global unicast;
//!   the rest is reserved by the IETF, unique-local, link-local, the deprecated site-local
//!   `fec0::/10` of RFC 3879, or multicast), and the deprecated IPv4-compatible `::/96`
//!   (RFC 4291 §2.5.5.1).
//!
//! The rule: an address is public when the most specific range of the tables that holds it is
//! globally reachable (`Reachable::Yes`; `No` and `NotApplicable` are refused), or when no range
//! holds it and it is unicast (IPv4) or global unicast `2000::/3` (IPv6); and, for an IPv6
//! address that carries an IPv4 address ([`embedded_ipv4`]: mapped, compatible, NAT64, 6to4,
//! Teredo's server and client), every carried IPv4 address is public too, since a translator or
//! tunnel delivers the packet there.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// A registry's "Globally Reachable" column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reachable {
    /// `True`: forwardable beyond an administrative domain; such an address is public.
    Yes,
    /// `False`.
    No,
    /// `N/A` (deprecated blocks, Teredo, 6to4): refused like `No`.
    NotApplicable,
}

/// One special-purpose address block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecialRange {
    /// The block's first address.
    pub network: IpAddr,
    /// Its prefix length, bits.
    pub prefix_len: u8,
    /// The registry's name of the block.
    pub name: &'static str,
    /// Where it is defined (an RFC, or the registry that lists it).
    pub source: &'static str,
    /// The registry's "Globally Reachable" flag.
    pub globally_reachable: Reachable,
}

impl SpecialRange {
    /// Whether `ip` lies in this block (an IPv4 address is never in an IPv6 block: forms that
    /// carry one are handled by [`embedded_ipv4`]).
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.network, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(self.prefix_len)).unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX.checked_shl(128 - u32::from(self.prefix_len)).unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

#[allow(clippy::too_many_arguments)]
const fn v4(a: u8, b: u8, c: u8, d: u8, prefix_len: u8, name: &'static str, source: &'static str, reach: Reachable) -> SpecialRange {
    SpecialRange { network: IpAddr::V4(Ipv4Addr::new(a, b, c, d)), prefix_len, name, source, globally_reachable: reach }
}

const fn v6(s: [u16; 8], prefix_len: u8, name: &'static str, source: &'static str, reach: Reachable) -> SpecialRange {
    SpecialRange {
        network: IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7])),
        prefix_len,
        name,
        source,
        globally_reachable: reach,
    }
}

use Reachable::{No, NotApplicable as Na, Yes};

/// Every entry of the IANA IPv4 Special-Purpose Address Registry, in its order.
pub const IPV4_SPECIAL: &[SpecialRange] = &[
    v4(0, 0, 0, 0, 8, "\"This network\"", "RFC 791", No),
    v4(0, 0, 0, 0, 32, "\"This host on this network\"", "RFC 1122", No),
    v4(10, 0, 0, 0, 8, "Private-Use", "RFC 1918", No),
    v4(100, 64, 0, 0, 10, "Shared Address Space", "RFC 6598", No),
    v4(127, 0, 0, 0, 8, "Loopback", "RFC 1122", No),
    v4(169, 254, 0, 0, 16, "Link Local", "RFC 3927", No),
    v4(172, 16, 0, 0, 12, "Private-Use", "RFC 1918", No),
    v4(192, 0, 0, 0, 24, "IETF Protocol Assignments", "RFC 6890", No),
    v4(192, 0, 0, 0, 29, "IPv4 Service Continuity Prefix", "RFC 7335", No),
    v4(192, 0, 0, 8, 32, "IPv4 dummy address", "RFC 7600", No),
    v4(192, 0, 0, 9, 32, "Port Control Protocol Anycast", "RFC 7723", Yes),
    v4(192, 0, 0, 10, 32, "Traversal Using Relays around NAT Anycast", "RFC 8155", Yes),
    v4(192, 0, 0, 170, 32, "NAT64/DNS64 Discovery", "RFC 8880, RFC 7050", No),
    v4(192, 0, 0, 171, 32, "NAT64/DNS64 Discovery", "RFC 8880, RFC 7050", No),
    v4(192, 0, 2, 0, 24, "Documentation (TEST-NET-1)", "RFC 5737", No),
    v4(192, 31, 196, 0, 24, "AS112-v4", "RFC 7535", Yes),
    v4(192, 52, 193, 0, 24, "AMT", "RFC 7450", Yes),
    v4(192, 88, 99, 0, 24, "Deprecated (6to4 Relay Anycast)", "RFC 7526", Na),
    v4(192, 88, 99, 2, 32, "6a44-relay anycast address", "RFC 6751", No),
    v4(192, 168, 0, 0, 16, "Private-Use", "RFC 1918", No),
    v4(192, 175, 48, 0, 24, "Direct Delegation AS112 Service", "RFC 7534", Yes),
    v4(198, 18, 0, 0, 15, "Benchmarking", "RFC 2544", No),
    v4(198, 51, 100, 0, 24, "Documentation (TEST-NET-2)", "RFC 5737", No),
    v4(203, 0, 113, 0, 24, "Documentation (TEST-NET-3)", "RFC 5737", No),
    v4(240, 0, 0, 0, 4, "Reserved", "RFC 1112", No),
    v4(255, 255, 255, 255, 32, "Limited Broadcast", "RFC 8190, RFC 919", No),
];

/// Every entry of the IANA IPv6 Special-Purpose Address Registry, in its order.
pub const IPV6_SPECIAL: &[SpecialRange] = &[
    v6([0, 0, 0, 0, 0, 0, 0, 1], 128, "Loopback Address", "RFC 4291", No),
    v6([0; 8], 128, "Unspecified Address", "RFC 4291", No),
    v6([0, 0, 0, 0, 0, 0xffff, 0, 0], 96, "IPv4-mapped Address", "RFC 4291", No),
    v6([0x64, 0xff9b, 0, 0, 0, 0, 0, 0], 96, "IPv4-IPv6 Translat.", "RFC 6052", Yes),
    v6([0x64, 0xff9b, 1, 0, 0, 0, 0, 0], 48, "IPv4-IPv6 Translat.", "RFC 8215", No),
    v6([0x100, 0, 0, 0, 0, 0, 0, 0], 64, "Discard-Only Address Block", "RFC 6666", No),
    v6([0x100, 0, 0, 1, 0, 0, 0, 0], 64, "Dummy IPv6 Prefix", "RFC 9780", No),
    v6([0x2001, 0, 0, 0, 0, 0, 0, 0], 23, "IETF Protocol Assignments", "RFC 2928", No),
    v6([0x2001, 0, 0, 0, 0, 0, 0, 0], 32, "TEREDO", "RFC 4380, RFC 8190", Na),
    v6([0x2001, 1, 0, 0, 0, 0, 0, 1], 128, "Port Control Protocol Anycast", "RFC 7723", Yes),
    v6([0x2001, 1, 0, 0, 0, 0, 0, 2], 128, "Traversal Using Relays around NAT Anycast", "RFC 8155", Yes),
    v6([0x2001, 1, 0, 0, 0, 0, 0, 3], 128, "DNS-SD Service Registration Protocol Anycast", "RFC 9665", Yes),
    v6([0x2001, 2, 0, 0, 0, 0, 0, 0], 48, "Benchmarking", "RFC 5180, RFC Errata 1752", No),
    v6([0x2001, 3, 0, 0, 0, 0, 0, 0], 32, "AMT", "RFC 7450", Yes),
    v6([0x2001, 4, 0x112, 0, 0, 0, 0, 0], 48, "AS112-v6", "RFC 7535", Yes),
    v6([0x2001, 0x10, 0, 0, 0, 0, 0, 0], 28, "Deprecated (previously ORCHID)", "RFC 4843", Na),
    v6([0x2001, 0x20, 0, 0, 0, 0, 0, 0], 28, "ORCHIDv2", "RFC 7343", Yes),
    v6([0x2001, 0x30, 0, 0, 0, 0, 0, 0], 28, "Drone Remote ID Protocol Entity Tags (DETs) Prefix", "RFC 9374", Yes),
    v6([0x2001, 0xdb8, 0, 0, 0, 0, 0, 0], 32, "Documentation", "RFC 3849", No),
    v6([0x2002, 0, 0, 0, 0, 0, 0, 0], 16, "6to4", "RFC 3056", Na),
    v6([0x2620, 0x4f, 0x8000, 0, 0, 0, 0, 0], 48, "Direct Delegation AS112 Service", "RFC 7534", Yes),
    v6([0x3fff, 0, 0, 0, 0, 0, 0, 0], 20, "Documentation", "RFC 9637", No),
    v6([0x5f00, 0, 0, 0, 0, 0, 0, 0], 16, "Segment Routing (SRv6) SIDs", "RFC 9602", No),
    v6([0xfc00, 0, 0, 0, 0, 0, 0, 0], 7, "Unique-Local", "RFC 4193, RFC 8190", No),
    v6([0xfe80, 0, 0, 0, 0, 0, 0, 0], 10, "Link-Local Unicast", "RFC 4291", No),
];

/// Blocks the special-purpose registries do not list that are never a destination on the
/// internet: multicast (a request is unicast), and the deprecated IPv6 forms.
pub const OTHER_REFUSED: &[SpecialRange] = &[
    v4(224, 0, 0, 0, 4, "Multicast", "RFC 5771", No),
    v6([0xff00, 0, 0, 0, 0, 0, 0, 0], 8, "Multicast", "RFC 4291 §2.7", No),
    v6([0; 8], 96, "IPv4-Compatible IPv6 Address (deprecated)", "RFC 4291 §2.5.5.1", No),
    v6([0xfec0, 0, 0, 0, 0, 0, 0, 0], 10, "Site-Local (deprecated)", "RFC 3879", No),
];

/// IANA's global unicast space, `2000::/3` (IPv6 Address Space registry): an IPv6 address
/// outside it and outside every table is reserved, so not public.
const GLOBAL_UNICAST: SpecialRange = v6([0x2000, 0, 0, 0, 0, 0, 0, 0], 3, "Global Unicast", "RFC 4291", Yes);

/// The most specific range of the tables that holds `ip`, if any.
pub fn special_range(ip: IpAddr) -> Option<&'static SpecialRange> {
    IPV4_SPECIAL.iter().chain(IPV6_SPECIAL).chain(OTHER_REFUSED).filter(|r| r.contains(ip)).max_by_key(|r| r.prefix_len)
}

/// The IPv4 addresses an IPv6 address carries, by its form: IPv4-mapped `::ffff:a.b.c.d` and
/// IPv4-compatible `::a.b.c.d` (RFC 4291 §2.5.5), NAT64 `64:ff9b::a.b.c.d` (RFC 6052 §2.1; the
/// local-use `64:ff9b:1::/48` of RFC 8215 is refused whole), 6to4 `2002:AABB:CCDD::/48`
/// (RFC 3056 §2), Teredo `2001:0:<server>:<flags>:<port>:<client XOR ffffffff>` (RFC 4380 §4:
/// the server's address and the client's, whose bits are inverted). Empty for other addresses.
pub fn embedded_ipv4(ip: Ipv6Addr) -> Vec<Ipv4Addr> {
    let bits = u128::from(ip);
    let low32 = Ipv4Addr::from(bits as u32);
    let s = ip.segments();
    let in_range = |net: [u16; 8], len: u8| v6(net, len, "", "", No).contains(IpAddr::V6(ip));
    if in_range([0, 0, 0, 0, 0, 0xffff, 0, 0], 96) || in_range([0; 8], 96) || in_range([0x64, 0xff9b, 0, 0, 0, 0, 0, 0], 96) {
        vec![low32]
    } else if s[0] == 0x2002 {
        vec![Ipv4Addr::from((bits >> 80) as u32)]
    } else if s[0] == 0x2001 && s[1] == 0 {
        vec![Ipv4Addr::from((bits >> 64) as u32), Ipv4Addr::from(!(bits as u32))]
    } else {
        Vec::new()
    }
}

/// Whether `ip` may be reached on a tenant's behalf (a webhook, an egress connection): the
/// module's rule, from the IANA registries.
pub fn is_public(ip: IpAddr) -> bool {
    let reachable = match special_range(ip) {
        Some(range) => range.globally_reachable == Yes,
        None => match ip {
            IpAddr::V4(_) => true,
            IpAddr::V6(_) => GLOBAL_UNICAST.contains(ip),
        },
    };
    reachable
        && match ip {
            IpAddr::V4(_) => true,
            IpAddr::V6(v6) => embedded_ipv4(v6).into_iter().all(|v4| is_public(IpAddr::V4(v4))),
        }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One address inside and one just outside each range of the registries, and the answer
    /// written by hand from the registries' "Globally Reachable" column (not from the tables).
    const CASES: &[(&str, bool)] = &[
        // IPv4 Special-Purpose registry.
        ("0.255.255.255", false), // 0.0.0.0/8
        ("1.0.0.0", true),        // after 0.0.0.0/8
        ("0.0.0.0", false),       // 0.0.0.0/32
        ("0.0.0.1", false),       // after 0.0.0.0/32: still 0.0.0.0/8
        ("10.20.30.40", false),   // 10.0.0.0/8
        ("9.255.255.255", true),
        ("11.0.0.0", true),
        ("100.64.0.0", false), // 100.64.0.0/10
        ("100.127.255.255", false),
        ("100.63.255.255", true),
        ("100.128.0.0", true),
        ("127.0.0.1", false), // 127.0.0.0/8
        ("127.255.255.254", false),
        ("126.255.255.255", true),
        ("128.0.0.0", true),
        ("169.254.169.254", false), // 169.254.0.0/16
        ("169.253.255.255", true),
        ("169.255.0.0", true),
        ("172.16.0.1", false), // 172.16.0.0/12
        ("172.31.255.255", false),
        ("172.15.255.255", true),
        ("172.32.0.0", true),
        ("192.0.0.100", false), // 192.0.0.0/24
        ("192.0.1.0", true),
        ("191.255.255.255", true),
        ("192.0.0.7", false), // 192.0.0.0/29
        ("192.0.0.8", false), // 192.0.0.8/32
        ("192.0.0.9", true),  // 192.0.0.9/32: globally reachable
        ("192.0.0.10", true), // 192.0.0.10/32: globally reachable
        ("192.0.0.11", false),
        ("192.0.0.170", false), // 192.0.0.170/32
        ("192.0.0.171", false), // 192.0.0.171/32
        ("192.0.0.172", false),
        ("192.0.2.55", false), // 192.0.2.0/24
        ("192.0.3.0", true),
        ("192.31.196.1", true), // 192.31.196.0/24: globally reachable
        ("192.52.193.1", true), // 192.52.193.0/24: globally reachable
        ("192.88.99.1", false), // 192.88.99.0/24: N/A
        ("192.88.99.2", false), // 192.88.99.2/32
        ("192.88.98.255", true),
        ("192.88.100.0", true),
        ("192.168.1.1", false), // 192.168.0.0/16
        ("192.167.255.255", true),
        ("192.169.0.0", true),
        ("192.175.48.1", true), // 192.175.48.0/24: globally reachable
        ("198.18.0.2", false),  // 198.18.0.0/15
        ("198.19.255.255", false),
        ("198.17.255.255", true),
        ("198.20.0.0", true),
        ("198.51.100.7", false), // 198.51.100.0/24
        ("198.51.101.0", true),
        ("203.0.113.9", false), // 203.0.113.0/24
        ("203.0.114.0", true),
        ("240.0.0.1", false), // 240.0.0.0/4
        ("255.255.255.254", false),
        ("255.255.255.255", false), // limited broadcast
        // Multicast.
        ("224.0.0.1", false),
        ("239.255.255.255", false),
        ("223.255.255.255", true),
        // Public.
        ("1.1.1.1", true),
        ("8.8.8.8", true),
        // IPv6 Special-Purpose registry.
        ("::1", false),                // loopback
        ("::2", false),                // after it: IPv4-compatible ::0.0.0.2 (deprecated)
        ("::", false),                 // unspecified
        ("::ffff:127.0.0.1", false),   // IPv4-mapped
        ("::ffff:8.8.8.8", false),     // IPv4-mapped: not globally reachable whatever it carries
        ("::fffe:808:808", false),     // just below: reserved ::/8
        ("64:ff9b::7f00:1", false),    // NAT64 of 127.0.0.1
        ("64:ff9b::a00:1", false),     // NAT64 of 10.0.0.1
        ("64:ff9b::a9fe:a9fe", false), // NAT64 of 169.254.169.254
        ("64:ff9b::808:808", true),    // NAT64 of 8.8.8.8
        ("64:ff9b::1:808:808", false), // just outside the /96: reserved space
        ("64:ff9b:1::808:808", false), // 64:ff9b:1::/48, local use
        ("64:ff9b:2::", false),
        ("100::1", false),                               // discard-only 100::/64
        ("100:0:0:1::1", false),                         // dummy prefix 100:0:0:1::/64
        ("100:0:0:2::", false),                          // after both: reserved 0100::/8
        ("2001:0:4136:e378:8000:63bf:3fff:fdd2", false), // Teredo (RFC 4380's example)
        ("2001:1::1", true),                             // PCP anycast
        ("2001:1::2", true),                             // TURN anycast
        ("2001:1::3", true),                             // DNS-SD SRP anycast
        ("2001:1::4", false),                            // rest of 2001::/23
        ("2001:2::1", false),                            // benchmarking 2001:2::/48
        ("2001:2:1::", false),
        ("2001:3::1", true),         // AMT 2001:3::/32
        ("2001:4:112::1", true),     // AS112-v6
        ("2001:4:113::1", false),    // rest of 2001::/23
        ("2001:10::1", false),       // deprecated ORCHID
        ("2001:20::1", true),        // ORCHIDv2
        ("2001:30::1", true),        // DETs
        ("2001:40::1", false),       // rest of 2001::/23
        ("2001:1ff:ffff::1", false), // end of 2001::/23
        ("2001:200::1", true),       // after 2001::/23
        ("2001:db8::1", false),      // documentation
        ("2001:db9::1", true),
        ("2002:7f00:1::1", false),  // 6to4 of 127.0.0.1
        ("2002:808:808::1", false), // 6to4: N/A whatever it carries
        ("2003::1", true),
        ("2620:4f:8000::1", true), // AS112 direct delegation
        ("3fff::1", false),        // documentation 3fff::/20
        ("3fff:1000::1", true),
        ("5f00::1", false),      // SRv6 SIDs
        ("fc00::1", false),      // unique-local
        ("fdff:ffff::1", false), // unique-local
        ("fe80::1", false),      // link-local
        ("febf::1", false),
        ("fec0::1", false), // site-local (deprecated)
        ("feff::1", false),
        ("ff02::1", false),      // multicast
        ("1fff:ffff::1", false), // before 2000::/3: reserved
        ("4000::1", false),      // after 2000::/3: reserved
        ("2606:4700::1111", true),
    ];

    #[test]
    fn every_registry_range_decides_as_its_globally_reachable_flag_says() {
        for (addr, public) in CASES {
            assert_eq!(is_public(addr.parse().expect("address")), *public, "{addr}");
        }
    }

    #[test]
    fn the_embedded_ipv4_address_of_each_form_is_found() {
        let cases: &[(&str, &[&str])] = &[
            ("::ffff:10.0.0.1", &["10.0.0.1"]),
            ("::10.0.0.1", &["10.0.0.1"]),
            ("64:ff9b::10.0.0.1", &["10.0.0.1"]),
            ("2002:c000:204::1", &["192.0.2.4"]),
            // RFC 4380 §4's example: server 65.54.227.120, client 192.0.2.45.
            ("2001:0:4136:e378:8000:63bf:3fff:fdd2", &["65.54.227.120", "192.0.2.45"]),
            ("2606:4700::1111", &[]),
        ];
        for (v6, want) in cases {
            let got = embedded_ipv4(v6.parse().expect("v6"));
            let want: Vec<Ipv4Addr> = want.iter().map(|w| w.parse().expect("v4")).collect();
            assert_eq!(got, want, "{v6}");
        }
    }

    #[test]
    fn the_most_specific_range_decides() {
        assert_eq!(special_range("192.0.0.9".parse().expect("ip")).map(|r| r.prefix_len), Some(32));
        assert_eq!(special_range("2001::1".parse().expect("ip")).map(|r| r.name), Some("TEREDO"));
        assert_eq!(special_range("8.8.8.8".parse().expect("ip")), None);
    }
}
