//! Packages installed at run time (`pip install`, `%pip install`, `npm install`) and the TLS
//! trust and package indexes sandboxes use for them.
//!
//! Where installed packages live: `/sandq/packages` ([`SANDBOX_PACKAGES`]), a directory of the
//! job's disk next to `/work` (within the same quota), owned by the sandbox user, so that
//! `/work` holds only what the job brought or wrote:
//! - Python: `PYTHONUSERBASE=/sandq/packages/python`; pip installs there (its "user
//!   installation", chosen by pip itself because the image's site-packages is read-only), and
//!   the user site `/sandq/packages/python/lib/python3.X/site-packages` is made by the worker
//!   before the interpreter starts, so that Python puts it on `sys.path` at start-up (it adds
//!   the user site only if it exists then) and a package installed by the job imports in the
//!   same job, warm sandboxes included. `PIP_BREAK_SYSTEM_PACKAGES=1` lifts Debian's PEP 668
//!   refusal (`EXTERNALLY-MANAGED`) for every pip command: the image's packages stay
//!   read-only, only the user site changes.
//! - Node.js: npm in its global location with `prefix=/sandq/packages/node` (`npm install
//!   NAME` puts the package in `/sandq/packages/node/lib/node_modules`, its commands in
//!   `/sandq/packages/node/bin`), found by `require` through `NODE_PATH` (read when Node
//!   starts, so warm sandboxes start with it).
//!
//! Being outside `/work`, installed packages are never artifacts; in a session they are kept as
//! one archive next to the session's files ([`crate::session::packages`]).

use std::path::{Path, PathBuf};

use crate::layout::{SANDBOX_CA_BUNDLE, SANDBOX_PACKAGES};

/// Most bytes of `worker.extra_ca_certs` read (a bundle of a few hundred certificates is
/// well under it: Debian's whole bundle of 146 CAs is 222 KB).
pub(crate) const MAX_EXTRA_CA_BYTES: u64 = 1 << 20;

/// The package settings of the worker, validated ([`crate::settings::RawWorker`]).
#[derive(Debug, Clone, Default)]
pub struct Packages {
    /// The user site below `/sandq/packages/python`: `lib/python3.X/site-packages`, from the
    /// image's `python3` link.
    pub python_site: String,
    /// The image's CA bundle followed by `worker.extra_ca_certs`, when that is set: written to
    /// each outbound job's `src/` and bind-mounted at [`SANDBOX_CA_BUNDLE`].
    pub ca_bundle: Option<std::sync::Arc<[u8]>>,
    /// The index pip installs from (`worker.pip_index_url`), set as `PIP_INDEX_URL`.
    pub pip_index_url: Option<String>,
    /// `PIP_EXTRA_INDEX_URL` (space-separated there).
    pub pip_extra_index_urls: Vec<String>,
    /// `PIP_TRUSTED_HOST` (space-separated there).
    pub pip_trusted_hosts: Vec<String>,
    /// `npm_config_registry`.
    pub npm_registry: Option<String>,
}

/// Why a package setting is unusable.
#[derive(Debug, thiserror::Error)]
pub enum PackageSettingsError {
    /// `worker.extra_ca_certs` cannot be read.
    #[error("worker.extra_ca_certs {path}: cannot read it: {source}")]
    ReadCa {
        /// `worker.extra_ca_certs`.
        path: PathBuf,
        /// The I/O error of opening or reading it.
        source: std::io::Error,
    },
    /// `worker.extra_ca_certs` is not a PEM file of certificates.
    #[error("worker.extra_ca_certs {path}: {problem}")]
    BadCa {
        /// `worker.extra_ca_certs`.
        path: PathBuf,
        /// What is wrong, in words (too large, not UTF-8, a [`PemError`]).
        problem: String,
    },
    /// The image has no CA bundle to add the extra certificates to.
    #[error("the sandbox image has no CA bundle at {path}: {source}")]
    ImageBundle {
        /// The image's bundle (`<rootfs>/etc/ssl/certs/ca-certificates.crt`).
        path: PathBuf,
        /// The I/O error of reading it.
        source: std::io::Error,
    },
    /// The image's `python3` is not a link to `python3.X`.
    #[error("cannot tell the image's Python version from {path}: {problem}")]
    PythonVersion {
        /// `usr/bin/python3` in the rootfs.
        path: PathBuf,
        /// What was found.
        problem: String,
    },
    /// An index or registry URL is malformed.
    #[error("{key}: {value:?} is not an http(s) URL with a host")]
    Url {
        /// The setting's name (`worker.pip_index_url`...).
        key: &'static str,
        /// Its value, as configured.
        value: String,
    },
    /// A trusted host is malformed.
    #[error("worker.pip_trusted_hosts: {0:?} is not a host name or host:port")]
    Host(String),
}

/// The settings as written in `[worker]`.
#[derive(Debug, Clone, Default)]
pub(crate) struct RawPackages<'a> {
    /// `worker.extra_ca_certs`.
    pub extra_ca_certs: Option<&'a Path>,
    /// `worker.pip_index_url`.
    pub pip_index_url: Option<&'a str>,
    /// `worker.pip_extra_index_urls`, comma-separated.
    pub pip_extra_index_urls: Option<&'a str>,
    /// `worker.pip_trusted_hosts`, comma-separated.
    pub pip_trusted_hosts: Option<&'a str>,
    /// `worker.npm_registry`.
    pub npm_registry: Option<&'a str>,
}

/// True for `http://` or `https://` followed by a host, with no whitespace or quote (the value
/// goes into an environment variable that pip splits on whitespace).
fn is_http_url(value: &str) -> bool {
    let rest = value.strip_prefix("https://").or_else(|| value.strip_prefix("http://"));
    rest.is_some_and(|rest| {
        let host = rest.split(['/', '?', '#']).next().unwrap_or("");
        let host = host.rsplit('@').next().unwrap_or("");
        !host.is_empty() && !host.starts_with(':')
    }) && !value.chars().any(|c| c.is_whitespace() || c == '"' || c == '\'' || c.is_control())
}

/// The line opening a PEM certificate.
const PEM_BEGIN: &str = "-----BEGIN CERTIFICATE-----";
/// The line closing a PEM certificate.
const PEM_END: &str = "-----END CERTIFICATE-----";

/// Why a text is not a bundle of PEM certificates ([`count_pem_certificates`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum PemError {
    /// A certificate's `BEGIN` line has no `END` line after it.
    #[error("certificate {number} has no {PEM_END} line")]
    Unterminated {
        /// The certificate's position in the text, from 1.
        number: usize,
    },
    /// A certificate's body is not base64 of a DER SEQUENCE (first byte 0x30, over 16 bytes).
    #[error("certificate {number} is not base64 DER")]
    NotDer {
        /// The certificate's position in the text, from 1.
        number: usize,
    },
    /// The text has no certificate at all.
    #[error("no {PEM_BEGIN} block")]
    Empty,
}

/// The PEM certificates of `text`: each `-----BEGIN CERTIFICATE-----` block must decode as
/// base64 to a DER SEQUENCE (first byte 0x30). Returns how many there are.
///
/// # Errors
/// [`PemError`]: the first certificate that is not one, or none at all.
pub(crate) fn count_pem_certificates(text: &str) -> Result<usize, PemError> {
    use base64::Engine;
    let mut count = 0;
    let mut rest = text;
    while let Some(start) = rest.find(PEM_BEGIN) {
        let body_start = start + PEM_BEGIN.len();
        let Some(len) = rest[body_start..].find(PEM_END) else {
            return Err(PemError::Unterminated { number: count + 1 });
        };
        let body: String = rest[body_start..body_start + len].chars().filter(|c| !c.is_whitespace()).collect();
        match base64::engine::general_purpose::STANDARD.decode(body.as_bytes()) {
            Ok(der) if der.first() == Some(&0x30) && der.len() > 16 => count += 1,
            _ => return Err(PemError::NotDer { number: count + 1 }),
        }
        rest = &rest[body_start + len + PEM_END.len()..];
    }
    if count == 0 {
        return Err(PemError::Empty);
    }
    Ok(count)
}

impl RawPackages<'_> {
    /// Checks the settings against the image at `rootfs` and makes the combined CA bundle.
    ///
    /// # Errors
    /// [`PackageSettingsError`] naming the setting.
    pub(crate) fn validate(&self, rootfs: &Path) -> Result<Packages, PackageSettingsError> {
        let link = rootfs.join("usr/bin/python3");
        let target =
            std::fs::read_link(&link).map_err(|e| PackageSettingsError::PythonVersion { path: link.clone(), problem: e.to_string() })?;
        let name = target.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let version = name.strip_prefix("python3.").filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()));
        let Some(version) = version else {
            return Err(PackageSettingsError::PythonVersion { path: link, problem: format!("it points to {}", target.display()) });
        };
        let ca_bundle = match self.extra_ca_certs {
            None => None,
            Some(path) => {
                use std::io::Read;
                let bad = |problem: String| PackageSettingsError::BadCa { path: path.to_path_buf(), problem };
                let file = std::fs::File::open(path).map_err(|source| PackageSettingsError::ReadCa { path: path.to_path_buf(), source })?;
                let mut extra = Vec::new();
                file.take(MAX_EXTRA_CA_BYTES + 1)
                    .read_to_end(&mut extra)
                    .map_err(|source| PackageSettingsError::ReadCa { path: path.to_path_buf(), source })?;
                if extra.len() as u64 > MAX_EXTRA_CA_BYTES {
                    return Err(bad(format!("larger than {MAX_EXTRA_CA_BYTES} bytes")));
                }
                let text = std::str::from_utf8(&extra).map_err(|_| bad("not UTF-8 text (PEM expected)".into()))?;
                count_pem_certificates(text).map_err(|e| bad(e.to_string()))?;
                let image = rootfs.join(SANDBOX_CA_BUNDLE.trim_start_matches('/'));
                let mut bundle =
                    std::fs::read(&image).map_err(|source| PackageSettingsError::ImageBundle { path: image.clone(), source })?;
                if !bundle.ends_with(b"\n") {
                    bundle.push(b'\n');
                }
                bundle.extend_from_slice(&extra);
                Some(std::sync::Arc::from(bundle))
            }
        };
        let url = |key: &'static str, value: &str| {
            if is_http_url(value) {
                Ok(value.to_owned())
            } else {
                Err(PackageSettingsError::Url { key, value: value.to_owned() })
            }
        };
        let list = |text: Option<&str>| -> Vec<String> {
            text.unwrap_or("").split(',').map(str::trim).filter(|i| !i.is_empty()).map(str::to_owned).collect()
        };
        let pip_extra_index_urls =
            list(self.pip_extra_index_urls).iter().map(|u| url("worker.pip_extra_index_urls", u)).collect::<Result<_, _>>()?;
        let pip_trusted_hosts = list(self.pip_trusted_hosts);
        for host in &pip_trusted_hosts {
            if !host.bytes().all(|b| b.is_ascii_alphanumeric() || b"-.:[]".contains(&b)) {
                return Err(PackageSettingsError::Host(host.clone()));
            }
        }
        Ok(Packages {
            python_site: format!("lib/python3.{version}/site-packages"),
            ca_bundle,
            pip_index_url: self.pip_index_url.map(|u| url("worker.pip_index_url", u)).transpose()?,
            pip_extra_index_urls,
            pip_trusted_hosts,
            npm_registry: self.npm_registry.map(|u| url("worker.npm_registry", u)).transpose()?,
        })
    }
}

impl Packages {
    /// The sandbox's environment for installing and finding packages (every sandbox, warm ones
    /// from their start: `NODE_PATH` and `NODE_EXTRA_CA_CERTS` are read when Node starts).
    pub fn environment(&self) -> Vec<String> {
        let base = SANDBOX_PACKAGES;
        let mut env = vec![
            format!("PYTHONUSERBASE={base}/python"),
            // Debian's pip refuses any install into its Python (PEP 668), user installs too;
            // the image stays read-only whatever pip does, so the refusal protects nothing here.
            "PIP_BREAK_SYSTEM_PACKAGES=1".to_owned(),
            "PIP_DISABLE_PIP_VERSION_CHECK=1".to_owned(),
            // pip's cache would sit in /tmp, a tmpfs charged to the job's memory.
            "PIP_NO_CACHE_DIR=1".to_owned(),
            format!("NODE_PATH={base}/node/lib/node_modules"),
            format!("npm_config_prefix={base}/node"),
            "npm_config_location=global".to_owned(),
            "npm_config_update_notifier=false".to_owned(),
            "npm_config_fund=false".to_owned(),
            "npm_config_audit=false".to_owned(),
        ];
        if let Some(url) = &self.pip_index_url {
            env.push(format!("PIP_INDEX_URL={url}"));
        }
        if !self.pip_extra_index_urls.is_empty() {
            env.push(format!("PIP_EXTRA_INDEX_URL={}", self.pip_extra_index_urls.join(" ")));
        }
        if !self.pip_trusted_hosts.is_empty() {
            env.push(format!("PIP_TRUSTED_HOST={}", self.pip_trusted_hosts.join(" ")));
        }
        if let Some(url) = &self.npm_registry {
            env.push(format!("npm_config_registry={url}"));
        }
        if self.ca_bundle.is_some() {
            // OpenSSL (Python's ssl, curl...) reads the bundle at its usual path anyway; these
            // reach what does not: Node's own root store, requests, pip.
            for name in ["SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT", "NODE_EXTRA_CA_CERTS"] {
                env.push(format!("{name}={SANDBOX_CA_BUNDLE}"));
            }
        }
        env
    }

    /// `PATH` additions: the commands of installed packages, after the image's.
    pub fn path_suffix() -> String {
        format!(":{SANDBOX_PACKAGES}/python/bin:{SANDBOX_PACKAGES}/node/bin")
    }

    /// Bytes the CA bundle takes in a job's `src/`.
    pub fn ca_bundle_bytes(&self) -> usize {
        self.ca_bundle.as_ref().map_or(0, |b| b.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_pem_are_checked() {
        assert!(is_http_url("https://pypi.example.com/simple/"));
        assert!(is_http_url("http://10.0.0.5:3141/root/pypi/+simple/"));
        assert!(is_http_url("https://user:pw@mirror.example/simple"));
        for bad in ["ftp://x/", "https://", "https:///simple", "https://a b/", "pypi.org/simple", "https://:80/"] {
            assert!(!is_http_url(bad), "{bad}");
        }
        // A DER SEQUENCE (0x30 0x82 ...) of 20 bytes, base64.
        use base64::Engine;
        let der: Vec<u8> = [0x30u8, 0x12].into_iter().chain(std::iter::repeat_n(7u8, 18)).collect();
        let b64 = base64::engine::general_purpose::STANDARD.encode(&der);
        let pem = format!("-----BEGIN CERTIFICATE-----\n{b64}\n-----END CERTIFICATE-----\n");
        assert_eq!(count_pem_certificates(&format!("junk\n{pem}{pem}")), Ok(2));
        assert_eq!(count_pem_certificates("nothing"), Err(PemError::Empty));
        assert_eq!(
            count_pem_certificates(&format!("{pem}-----BEGIN CERTIFICATE-----\n!!!\n-----END CERTIFICATE-----")),
            Err(PemError::NotDer { number: 2 })
        );
        assert_eq!(count_pem_certificates("-----BEGIN CERTIFICATE-----\nMIIB"), Err(PemError::Unterminated { number: 1 }));
        assert_eq!(PemError::Empty.to_string(), "no -----BEGIN CERTIFICATE----- block");
        assert_eq!(PemError::Unterminated { number: 1 }.to_string(), "certificate 1 has no -----END CERTIFICATE----- line");
        assert_eq!(PemError::NotDer { number: 2 }.to_string(), "certificate 2 is not base64 DER");
    }

    #[test]
    fn settings_are_checked_against_the_image_and_the_ca_file() {
        use base64::Engine;
        let dir = tempfile::tempdir().expect("tempdir");
        let rootfs = dir.path().join("rootfs");
        std::fs::create_dir_all(rootfs.join("usr/bin")).expect("usr/bin");
        std::fs::create_dir_all(rootfs.join("etc/ssl/certs")).expect("certs");
        std::os::unix::fs::symlink("python3.13", rootfs.join("usr/bin/python3")).expect("python3");
        std::fs::write(rootfs.join("etc/ssl/certs/ca-certificates.crt"), "IMAGE BUNDLE").expect("bundle");
        let der: Vec<u8> = [0x30u8, 0x12].into_iter().chain(std::iter::repeat_n(7u8, 18)).collect();
        let pem =
            format!("-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n", base64::engine::general_purpose::STANDARD.encode(&der));
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, &pem).expect("ca");
        let raw = RawPackages {
            extra_ca_certs: Some(&ca),
            pip_index_url: Some("https://pypi.example/simple/"),
            pip_extra_index_urls: Some("https://a.example/simple/, https://b.example/simple/"),
            pip_trusted_hosts: Some("pypi.example,10.0.0.5:3141"),
            npm_registry: Some("https://npm.example/"),
        };
        let packages = raw.validate(&rootfs).expect("valid");
        assert_eq!(packages.python_site, "lib/python3.13/site-packages");
        assert_eq!(packages.ca_bundle.as_deref(), Some(format!("IMAGE BUNDLE\n{pem}").as_bytes()));
        let env = packages.environment();
        for expected in [
            "PIP_INDEX_URL=https://pypi.example/simple/",
            "PIP_EXTRA_INDEX_URL=https://a.example/simple/ https://b.example/simple/",
            "PIP_TRUSTED_HOST=pypi.example 10.0.0.5:3141",
            "npm_config_registry=https://npm.example/",
            "NODE_EXTRA_CA_CERTS=/etc/ssl/certs/ca-certificates.crt",
            "PYTHONUSERBASE=/sandq/packages/python",
            "NODE_PATH=/sandq/packages/node/lib/node_modules",
        ] {
            assert!(env.iter().any(|e| e == expected), "{expected} missing from {env:?}");
        }
        // Each bad value is refused with the error naming it.
        let bad_url = RawPackages { npm_registry: Some("registry.npmjs.org"), ..Default::default() };
        assert!(matches!(bad_url.validate(&rootfs), Err(PackageSettingsError::Url { key: "worker.npm_registry", .. })));
        let missing = dir.path().join("missing.pem");
        let no_file = RawPackages { extra_ca_certs: Some(&missing), ..Default::default() };
        assert!(matches!(no_file.validate(&rootfs), Err(PackageSettingsError::ReadCa { .. })));
        let key = dir.path().join("key.pem");
        std::fs::write(&key, "-----BEGIN PRIVATE KEY-----\nMIIB\n-----END PRIVATE KEY-----\n").expect("key");
        let not_a_cert = RawPackages { extra_ca_certs: Some(&key), ..Default::default() };
        assert!(matches!(not_a_cert.validate(&rootfs), Err(PackageSettingsError::BadCa { .. })));
        let host = RawPackages { pip_trusted_hosts: Some("a b"), ..Default::default() };
        assert!(matches!(host.validate(&rootfs), Err(PackageSettingsError::Host(_))));
        // Without settings: no CA bundle, no index variables.
        let plain = RawPackages::default().validate(&rootfs).expect("defaults");
        assert!(plain.ca_bundle.is_none());
        assert!(!plain.environment().iter().any(|e| e.starts_with("PIP_INDEX_URL") || e.starts_with("NODE_EXTRA_CA_CERTS")));
        std::fs::remove_file(rootfs.join("usr/bin/python3")).expect("rm");
        std::os::unix::fs::symlink("python", rootfs.join("usr/bin/python3")).expect("python3");
        assert!(matches!(RawPackages::default().validate(&rootfs), Err(PackageSettingsError::PythonVersion { .. })));
    }
}
