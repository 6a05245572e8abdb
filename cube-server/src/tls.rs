//! TLS for the main listener (rustls, ring): a PEM certificate chain and key, ALPN
//! offering HTTP/2 and HTTP/1.1.

use std::sync::Arc;

use tokio_rustls::rustls::pki_types::pem::PemObject as _;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;

use crate::config::TlsFiles;

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The certificate file is unreadable or holds no certificate.
    #[error("Reading the certificate {0}")]
    Cert(
        String,
        #[source] tokio_rustls::rustls::pki_types::pem::Error,
    ),
    /// The key file is unreadable or holds no private key.
    #[error("Reading the private key {0}")]
    Key(
        String,
        #[source] tokio_rustls::rustls::pki_types::pem::Error,
    ),
    /// rustls refused the pair.
    #[error("The certificate and key do not make a TLS configuration")]
    Config(#[source] tokio_rustls::rustls::Error),
}

/// An acceptor for the certificate and key in `files`.
pub fn acceptor(files: &TlsFiles) -> Result<TlsAcceptor, TlsError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&files.cert)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| TlsError::Cert(files.cert.display().to_string(), e))?;
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .map_err(|e| TlsError::Key(files.key.display().to_string(), e))?;
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let mut config = tokio_rustls::rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Config)?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(TlsError::Config)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}
