//! A certificate authority for one pipeline: a self-signed CA that signs worker certificates
//! for the names ranks dial (rcgen, ECDSA P-256).

use crate::{invalid, TlsError};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use std::time::Duration;
use time::OffsetDateTime;

/// Certificates start this long before they are made, so a clock a little behind the
/// issuer's does not refuse them.
const BACKDATE: Duration = Duration::from_secs(3600);

/// A certificate and its private key, in PEM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
}

pub struct Authority {
    issuer: Issuer<'static, KeyPair>,
    cert_pem: String,
}

fn validity(params: &mut CertificateParams, valid_for: Duration) {
    let now = OffsetDateTime::now_utc();
    params.not_before = now - BACKDATE;
    params.not_after = now + valid_for;
}

fn ca_params(name: &str) -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, name);
    params.distinguished_name = dn;
    // Signs leaf certificates only: no intermediate below it.
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    params
}

/// `base` and when it is made: two CAs made apart never share a subject, so a rank that
/// trusts one names the other as an unknown issuer (with one subject it could only say that
/// the signature is wrong).
pub fn unique_name(base: &str) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    format!("{base} {:x}.{}", now.as_nanos(), std::process::id())
}

impl Authority {
    /// A new CA named `name` (its subject's common name: [`unique_name`]), valid for
    /// `valid_for`.
    pub fn new(name: &str, valid_for: Duration) -> Result<Self, TlsError> {
        let key = KeyPair::generate().map_err(|e| invalid("a CA key", e))?;
        let mut params = ca_params(name);
        validity(&mut params, valid_for);
        let cert = params
            .self_signed(&key)
            .map_err(|e| invalid("the CA certificate", e))?;
        Ok(Authority {
            issuer: Issuer::new(params, key),
            cert_pem: cert.pem(),
        })
    }

    /// The CA made by [`Authority::new`] with this `name`, from its certificate and key (as
    /// kept in a Secret).
    pub fn from_pem(name: &str, cert_pem: &str, key_pem: &str) -> Result<Self, TlsError> {
        let key = KeyPair::from_pem(key_pem).map_err(|e| invalid("the CA key", e))?;
        Ok(Authority {
            issuer: Issuer::new(ca_params(name), key),
            cert_pem: cert_pem.into(),
        })
    }

    /// The CA certificate: what ranks trust.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    pub fn key_pem(&self) -> String {
        self.issuer.key().serialize_pem()
    }

    /// Writes this CA's certificate (`ca.crt`, what ranks trust) and `worker` (`tls.crt`, and
    /// `tls.key` readable by its owner only) into `dir`; the certificate's and the key's paths.
    pub fn write_files(
        &self,
        dir: &std::path::Path,
        worker: &Issued,
    ) -> std::io::Result<(std::path::PathBuf, std::path::PathBuf)> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let write = |name: &str, text: &str, mode: u32| {
            let path = dir.join(name);
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(mode)
                .open(&path)
                .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
            f.write_all(text.as_bytes())?;
            Ok::<_, std::io::Error>(path)
        };
        std::fs::create_dir_all(dir)?;
        write("ca.crt", self.cert_pem(), 0o644)?;
        let cert = write("tls.crt", &worker.cert_pem, 0o644)?;
        let key = write("tls.key", &worker.key_pem, 0o600)?;
        Ok((cert, key))
    }

    /// A server certificate for `names` (DNS names or IP addresses), with a fresh key.
    pub fn issue(&self, names: &[String], valid_for: Duration) -> Result<Issued, TlsError> {
        let mut params =
            CertificateParams::new(names.to_vec()).map_err(|e| invalid("certificate names", e))?;
        if let Some(first) = names.first() {
            params.distinguished_name.push(DnType::CommonName, first);
        }
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        validity(&mut params, valid_for);
        let key = KeyPair::generate().map_err(|e| invalid("a worker key", e))?;
        let cert = params
            .signed_by(&key, &self.issuer)
            .map_err(|e| invalid("a worker certificate", e))?;
        Ok(Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ClientTls, ServerTls};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const DAY: Duration = Duration::from_secs(86_400);

    /// One round trip through a server with `issued`, dialled as `host`.
    async fn round_trip(ca: &str, issued: &Issued, host: &str) -> std::io::Result<Vec<u8>> {
        let server =
            ServerTls::from_pem(issued.cert_pem.as_bytes(), issued.key_pem.as_bytes()).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            if let Ok(mut s) = server.accept(tcp).await {
                let mut b = [0u8; 5];
                s.read_exact(&mut b).await.unwrap();
                s.write_all(&b).await.unwrap();
                s.flush().await.unwrap();
            }
        });
        let client = ClientTls::from_ca_pem(ca.as_bytes()).unwrap();
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        let mut s = client.connect(host, tcp).await?;
        s.write_all(b"hello").await?;
        s.flush().await?;
        let mut b = vec![0u8; 5];
        s.read_exact(&mut b).await?;
        Ok(b)
    }

    #[tokio::test]
    async fn a_worker_certificate_is_trusted_for_its_names_only() {
        let ca = Authority::new("stoker test CA", DAY).unwrap();
        let names = ["localhost".to_string(), "127.0.0.1".to_string()];
        let issued = ca.issue(&names, DAY).unwrap();
        for host in ["localhost", "127.0.0.1"] {
            assert_eq!(
                round_trip(ca.cert_pem(), &issued, host).await.unwrap(),
                b"hello"
            );
        }
        let e = round_trip(ca.cert_pem(), &issued, "other.example")
            .await
            .unwrap_err();
        assert!(e.to_string().contains("as other.example"), "{e}");
        assert!(e.to_string().contains("not valid for name"), "{e}");

        // Another CA's certificate for the right name is refused too.
        let rogue = Authority::new("rogue", DAY)
            .unwrap()
            .issue(&names, DAY)
            .unwrap();
        let e = round_trip(ca.cert_pem(), &rogue, "localhost")
            .await
            .unwrap_err();
        assert!(e.to_string().contains("UnknownIssuer"), "{e}");
    }

    #[tokio::test]
    async fn an_authority_read_back_from_pem_signs_what_its_certificate_verifies() {
        let ca = Authority::new("stoker test CA", DAY).unwrap();
        let again = Authority::from_pem("stoker test CA", ca.cert_pem(), &ca.key_pem()).unwrap();
        let issued = again.issue(&["localhost".to_string()], DAY).unwrap();
        assert_eq!(
            round_trip(ca.cert_pem(), &issued, "localhost")
                .await
                .unwrap(),
            b"hello"
        );
    }

    #[test]
    fn pem_that_is_not_a_certificate_is_refused_by_name() {
        let e = ClientTls::from_ca_pem(b"not pem").err().unwrap();
        assert!(
            e.to_string().contains("the CA bundle: no PEM CERTIFICATE"),
            "{e}"
        );
    }
}
