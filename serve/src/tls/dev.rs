//! Throwaway certificates for local clusters (`tandem up --tls`) and tests: a CA made on the
//! spot, and certificates it signs that serve as both server and client identity (mutual TLS).
//! Nothing here is meant for a deployment: the keys are written unencrypted next to the
//! certificates and the CA key lives only as long as the [`DevCa`].

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose,
};

/// Why certificates could not be made or written.
#[derive(Debug, thiserror::Error)]
pub enum DevCertError {
    /// rcgen refused the parameters.
    #[error("generating a certificate: {0}")]
    Generate(#[from] rcgen::Error),
    /// A file could not be written.
    #[error("writing {}", .path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A CA made on the spot, with its key.
pub struct DevCa {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl DevCa {
    /// A new self-signed CA named `name`.
    pub fn new(name: &str) -> Result<DevCa, DevCertError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = params.self_signed(&key)?;
        Ok(DevCa { cert, key })
    }

    /// The CA certificate, PEM.
    pub fn cert_pem(&self) -> String {
        self.cert.pem()
    }

    /// A new certificate and key (PEM) named `name`, valid for the host names and IP addresses
    /// in `sans`, usable as server and as client identity.
    pub fn issue(&self, name: &str, sans: &[&str]) -> Result<(String, String), DevCertError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>())?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages =
            vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params.signed_by(&key, &self.cert, &self.key)?;
        Ok((cert.pem(), key.serialize_pem()))
    }
}

/// The files of a local cluster's certificates.
#[derive(Debug, Clone)]
pub struct ClusterCerts {
    /// The CA certificate (what clients verify servers with, and processes verify peers with).
    pub ca: PathBuf,
    /// The certificate every process of the cluster serves and presents.
    pub cert: PathBuf,
    /// Its key.
    pub key: PathBuf,
}

/// Makes a CA and one certificate for `localhost`, `127.0.0.1` and `::1`, and writes them into
/// `dir` (`ca.pem`, `cert.pem`, `key.pem`; the key readable by the owner only).
pub fn write_cluster_certs(dir: &Path) -> Result<ClusterCerts, DevCertError> {
    let ca = DevCa::new("tandem local CA")?;
    let (cert, key) = ca.issue("tandem local cluster", &["localhost", "127.0.0.1", "::1"])?;
    let out = ClusterCerts { ca: dir.join("ca.pem"), cert: dir.join("cert.pem"), key: dir.join("key.pem") };
    write(&out.ca, &ca.cert_pem(), 0o644)?;
    write(&out.cert, &cert, 0o644)?;
    write(&out.key, &key, 0o600)?;
    Ok(out)
}

fn write(path: &Path, text: &str, mode: u32) -> Result<(), DevCertError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let err = |source| DevCertError::Write { path: path.into(), source };
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(path)
        .map_err(err)?;
    f.write_all(text.as_bytes()).map_err(err)
}
