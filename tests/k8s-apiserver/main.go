// miniapiserver: a Kubernetes API server built from the upstream k8s.io/apiserver
// library (generic registry + etcd3 storage + watch cache + real REST handlers),
// serving the built-in k8s.io/api types that a Job-based controller needs.
// It does NOT contain kube-apiserver's per-type validation/defaulting
// (k8s.io/kubernetes/pkg/apis/*), nor any controllers.
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"reflect"
	"strings"
	"syscall"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	apimachineryvalidation "k8s.io/apimachinery/pkg/api/validation"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/util/validation/field"
	"k8s.io/apiserver/pkg/authentication/request/bearertoken"
	"k8s.io/apiserver/pkg/authentication/token/tokenfile"
	"k8s.io/apiserver/pkg/authorization/authorizerfactory"
	openapinamer "k8s.io/apiserver/pkg/endpoints/openapi"
	genericrequest "k8s.io/apiserver/pkg/endpoints/request"
	"k8s.io/apiserver/pkg/registry/generic"
	genericregistry "k8s.io/apiserver/pkg/registry/generic/registry"
	genericrest "k8s.io/apiserver/pkg/registry/generic/rest"
	"k8s.io/apiserver/pkg/registry/rest"
	genericapiserver "k8s.io/apiserver/pkg/server"
	"k8s.io/apiserver/pkg/server/options"
	"k8s.io/apiserver/pkg/storage"
	"k8s.io/apiserver/pkg/storage/names"
	"k8s.io/apiserver/pkg/util/compatibility"
	"k8s.io/kube-openapi/pkg/common"
	openapiutil "k8s.io/kube-openapi/pkg/util"
	"k8s.io/kube-openapi/pkg/validation/spec"
	generatedopenapi "miniapiserver/openapi"
	"sigs.k8s.io/structured-merge-diff/v6/fieldpath"
)

var (
	scheme = runtime.NewScheme()
	codecs = serializer.NewCodecFactory(scheme)
)

type kindDef struct {
	gv         schema.GroupVersion
	resource   string
	singular   string
	namespaced bool
	obj        runtime.Object
	list       runtime.Object
	status     bool
	short      []string
}

type shortNamed struct {
	*genericregistry.Store
	short []string
}

func (s *shortNamed) ShortNames() []string { return s.short }

var kinds = []kindDef{
	{batchv1.SchemeGroupVersion, "jobs", "job", true, &batchv1.Job{}, &batchv1.JobList{}, true, nil},
	{networkingv1.SchemeGroupVersion, "networkpolicies", "networkpolicy", true, &networkingv1.NetworkPolicy{}, &networkingv1.NetworkPolicyList{}, false, []string{"netpol"}},
	{corev1.SchemeGroupVersion, "pods", "pod", true, &corev1.Pod{}, &corev1.PodList{}, true, []string{"po"}},
	{corev1.SchemeGroupVersion, "services", "service", true, &corev1.Service{}, &corev1.ServiceList{}, true, []string{"svc"}},
	{corev1.SchemeGroupVersion, "secrets", "secret", true, &corev1.Secret{}, &corev1.SecretList{}, false, nil},
	{corev1.SchemeGroupVersion, "namespaces", "namespace", false, &corev1.Namespace{}, &corev1.NamespaceList{}, true, []string{"ns"}},
	{corev1.SchemeGroupVersion, "nodes", "node", false, &corev1.Node{}, &corev1.NodeList{}, true, []string{"no"}},
}

func init() {
	for _, k := range kinds {
		internal := schema.GroupVersion{Group: k.gv.Group, Version: runtime.APIVersionInternal}
		scheme.AddKnownTypes(k.gv, k.obj, k.list)
		// Same Go type registered as the "internal" version: no conversion needed.
		scheme.AddKnownTypes(internal, k.obj, k.list)
		metav1.AddToGroupVersion(scheme, k.gv)
	}
	// pods/log takes its options as a query; registered as the other kinds are.
	scheme.AddKnownTypes(corev1.SchemeGroupVersion, &corev1.PodLogOptions{})
	scheme.AddKnownTypes(schema.GroupVersion{Version: runtime.APIVersionInternal}, &corev1.PodLogOptions{})
	metav1.AddToGroupVersion(scheme, schema.GroupVersion{Version: "v1"})
	scheme.AddUnversionedTypes(schema.GroupVersion{Group: "", Version: "v1"},
		&metav1.Status{}, &metav1.APIVersions{}, &metav1.APIGroupList{}, &metav1.APIGroup{}, &metav1.APIResourceList{})
	for _, gv := range []schema.GroupVersion{batchv1.SchemeGroupVersion, networkingv1.SchemeGroupVersion, corev1.SchemeGroupVersion} {
		if err := scheme.SetVersionPriority(gv); err != nil {
			panic(err)
		}
	}
}

// ---- strategy: generic, reflection based (spec/status split, generation bump, metadata validation)

type strategy struct {
	runtime.ObjectTyper
	names.NameGenerator
	namespaced bool
	statusOnly bool
}

func field_(obj runtime.Object, name string) reflect.Value {
	return reflect.ValueOf(obj).Elem().FieldByName(name)
}

func (s strategy) NamespaceScoped() bool { return s.namespaced }
func (s strategy) PrepareForCreate(ctx context.Context, obj runtime.Object) {
	if st := field_(obj, "Status"); st.IsValid() {
		st.Set(reflect.Zero(st.Type()))
	}
	obj.(metav1.Object).SetGeneration(1)
}
func (s strategy) Validate(ctx context.Context, obj runtime.Object) field.ErrorList {
	return apimachineryvalidation.ValidateObjectMetaAccessor(obj.(metav1.Object), s.namespaced,
		apimachineryvalidation.NameIsDNSSubdomain, field.NewPath("metadata"))
}
func (s strategy) WarningsOnCreate(ctx context.Context, obj runtime.Object) []string { return nil }
func (s strategy) Canonicalize(obj runtime.Object)                                   {}
func (s strategy) AllowCreateOnUpdate() bool                                         { return false }
func (s strategy) AllowUnconditionalUpdate() bool                                    { return true }
func (s strategy) PrepareForUpdate(ctx context.Context, obj, old runtime.Object) {
	if s.statusOnly {
		// status subresource: keep everything but status (and metadata changes except as allowed)
		if sp := field_(obj, "Spec"); sp.IsValid() {
			sp.Set(field_(old, "Spec"))
		}
		nm, om := obj.(metav1.Object), old.(metav1.Object)
		nm.SetLabels(om.GetLabels())
		nm.SetAnnotations(om.GetAnnotations())
		nm.SetFinalizers(om.GetFinalizers())
		nm.SetOwnerReferences(om.GetOwnerReferences())
		return
	}
	if st := field_(obj, "Status"); st.IsValid() {
		st.Set(field_(old, "Status"))
	}
	om := old.(metav1.Object)
	gen := om.GetGeneration()
	if sp := field_(obj, "Spec"); sp.IsValid() && !reflect.DeepEqual(sp.Interface(), field_(old, "Spec").Interface()) {
		gen++
	}
	obj.(metav1.Object).SetGeneration(gen)
}
func (s strategy) ValidateUpdate(ctx context.Context, obj, old runtime.Object) field.ErrorList {
	return apimachineryvalidation.ValidateObjectMetaAccessorUpdate(obj.(metav1.Object), old.(metav1.Object), field.NewPath("metadata"))
}
func (s strategy) WarningsOnUpdate(ctx context.Context, obj, old runtime.Object) []string { return nil }
func (s strategy) GetResetFields() map[fieldpath.APIVersion]*fieldpath.Set                { return nil }

// ---- status subresource REST

type statusREST struct{ store *genericregistry.Store }

func (r *statusREST) New() runtime.Object { return r.store.New() }
func (r *statusREST) Destroy()            {}
func (r *statusREST) Get(ctx context.Context, name string, options *metav1.GetOptions) (runtime.Object, error) {
	return r.store.Get(ctx, name, options)
}
func (r *statusREST) Update(ctx context.Context, name string, objInfo rest.UpdatedObjectInfo, createValidation rest.ValidateObjectFunc, updateValidation rest.ValidateObjectUpdateFunc, forceAllowCreate bool, options *metav1.UpdateOptions) (runtime.Object, bool, error) {
	return r.store.Update(ctx, name, objInfo, createValidation, updateValidation, false, options)
}
func (r *statusREST) ConvertToTable(ctx context.Context, object runtime.Object, tableOptions runtime.Object) (*metav1.Table, error) {
	return r.store.ConvertToTable(ctx, object, tableOptions)
}

// ---- pods/log: streamed from the pod's node, as kube-apiserver does from the kubelet

// logREST answers GET pods/NAME/log by proxying the kubelet's /containerLogs of the
// node named in the pod's spec.nodeName, at the Node's InternalIP and kubelet port
// (status.daemonEndpoints.kubeletEndpoint.port). Only plain http: a test node.
type logREST struct{ pods, nodes *genericregistry.Store }

func (r *logREST) New() runtime.Object               { return &corev1.Pod{} }
func (r *logREST) Destroy()                          {}
func (r *logREST) ProducesMIMETypes(string) []string { return []string{"text/plain"} }
func (r *logREST) ProducesObject(string) interface{} { return "" }
func (r *logREST) NewGetOptions() (runtime.Object, bool, string) {
	return &corev1.PodLogOptions{}, false, ""
}

func (r *logREST) Get(ctx context.Context, name string, opts runtime.Object) (runtime.Object, error) {
	o, ok := opts.(*corev1.PodLogOptions)
	if !ok {
		return nil, apierrors.NewBadRequest(fmt.Sprintf("invalid options object: %#v", opts))
	}
	obj, err := r.pods.Get(ctx, name, &metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	pod := obj.(*corev1.Pod)
	container := o.Container
	if container == "" {
		if len(pod.Spec.Containers) != 1 {
			names := []string{}
			for _, c := range pod.Spec.Containers {
				names = append(names, c.Name)
			}
			return nil, apierrors.NewBadRequest(fmt.Sprintf("a container name must be specified for pod %s, choose one of: %v", name, names))
		}
		container = pod.Spec.Containers[0].Name
	}
	if pod.Spec.NodeName == "" {
		return nil, apierrors.NewBadRequest(fmt.Sprintf("pod %s does not have a host assigned", name))
	}
	nobj, err := r.nodes.Get(genericrequest.WithNamespace(ctx, metav1.NamespaceNone), pod.Spec.NodeName, &metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	node := nobj.(*corev1.Node)
	host := ""
	for _, a := range node.Status.Addresses {
		if a.Type == corev1.NodeInternalIP {
			host = a.Address
			break
		}
	}
	port := node.Status.DaemonEndpoints.KubeletEndpoint.Port
	if host == "" || port == 0 {
		return nil, apierrors.NewBadRequest(fmt.Sprintf("node %s has no InternalIP or kubelet port", node.Name))
	}
	query := url.Values{}
	if o.Follow {
		query.Set("follow", "true")
	}
	if o.Previous {
		query.Set("previous", "true")
	}
	if o.Timestamps {
		query.Set("timestamps", "true")
	}
	if o.TailLines != nil {
		query.Set("tailLines", fmt.Sprint(*o.TailLines))
	}
	if o.LimitBytes != nil {
		query.Set("limitBytes", fmt.Sprint(*o.LimitBytes))
	}
	location := &url.URL{
		Scheme:   "http",
		Host:     net.JoinHostPort(host, fmt.Sprint(port)),
		Path:     fmt.Sprintf("/containerLogs/%s/%s/%s", pod.Namespace, pod.Name, container),
		RawQuery: query.Encode(),
	}
	return &genericrest.LocationStreamer{
		Location:        location,
		Transport:       http.DefaultTransport,
		ContentType:     "text/plain",
		Flush:           o.Follow,
		ResponseChecker: genericrest.NewGenericHttpResponseChecker(corev1.Resource("pods/log"), name),
		RedirectChecker: genericrest.PreventRedirects,
	}, nil
}

// logOptionsCodec decodes pods/log's query into PodLogOptions (kube-apiserver does it
// with conversions generated in k8s.io/kubernetes, not in k8s.io/api); everything else
// goes to metav1's codec, as before.
type logOptionsCodec struct{ runtime.ParameterCodec }

func (c logOptionsCodec) DecodeParameters(parameters url.Values, from schema.GroupVersion, into runtime.Object) error {
	o, ok := into.(*corev1.PodLogOptions)
	if !ok {
		return c.ParameterCodec.DecodeParameters(parameters, from, into)
	}
	o.Container = parameters.Get("container")
	o.Follow = parameters.Get("follow") == "true"
	o.Previous = parameters.Get("previous") == "true"
	o.Timestamps = parameters.Get("timestamps") == "true"
	for key, target := range map[string]**int64{"tailLines": &o.TailLines, "limitBytes": &o.LimitBytes, "sinceSeconds": &o.SinceSeconds} {
		if v := parameters.Get(key); v != "" {
			var n int64
			if _, err := fmt.Sscan(v, &n); err != nil {
				return apierrors.NewBadRequest(fmt.Sprintf("%s=%q is not an integer", key, v))
			}
			*target = &n
		}
	}
	return nil
}

// ---- OpenAPI: permissive definitions (SSA needs a type converter; no generated openapi for k8s.io/api here)

func openAPIDefs(ref common.ReferenceCallback) map[string]common.OpenAPIDefinition {
	out := map[string]common.OpenAPIDefinition{}
	for _, k := range kinds {
		for _, o := range []runtime.Object{k.obj, k.list} {
			out[openapiutil.GetCanonicalTypeName(o)] = common.OpenAPIDefinition{Schema: spec.Schema{
				SchemaProps:      spec.SchemaProps{Type: []string{"object"}},
				VendorExtensible: spec.VendorExtensible{Extensions: spec.Extensions{"x-kubernetes-preserve-unknown-fields": true}},
			}}
		}
	}
	return out
}

func main() {
	etcd := flag.String("etcd-servers", "http://127.0.0.1:2379", "")
	port := flag.Int("secure-port", 6443, "")
	certDir := flag.String("cert-dir", "/tmp/miniapiserver-certs", "")
	tokenFile := flag.String("token-auth-file", "", "CSV token,user,uid,\"group1,group2\" (same format as kube-apiserver)")
	prefix := flag.String("etcd-prefix", "/registry", "")
	watchCache := flag.Bool("watch-cache", true, "serve watches/lists from the watch cache (false: straight from etcd, so compacted RVs give 410 Gone)")
	compaction := flag.Duration("etcd-compaction-interval", 5*time.Minute, "how often the apiserver compacts etcd (0 disables)")
	flag.Parse()

	ro := options.NewRecommendedOptions(*prefix, codecs.LegacyCodec(batchv1.SchemeGroupVersion, networkingv1.SchemeGroupVersion, corev1.SchemeGroupVersion))
	ro.Etcd.StorageConfig.Transport.ServerList = strings.Split(*etcd, ",")
	ro.Etcd.EnableWatchCache = *watchCache
	ro.Etcd.StorageConfig.CompactionInterval = *compaction
	ro.SecureServing.BindAddress = net.ParseIP("127.0.0.1")
	ro.SecureServing.BindPort = *port
	ro.SecureServing.ServerCert.CertDirectory = *certDir
	if err := ro.SecureServing.MaybeDefaultWithSelfSignedCerts("localhost", nil, []net.IP{net.ParseIP("127.0.0.1")}); err != nil {
		fail(err)
	}
	ro.Authentication, ro.Authorization, ro.CoreAPI, ro.Admission = nil, nil, nil, nil
	ro.Features.EnablePriorityAndFairness = false

	cfg := genericapiserver.NewRecommendedConfig(codecs)
	cfg.EffectiveVersion = compatibility.DefaultBuildEffectiveVersion()
	namer := openapinamer.NewDefinitionNamer(scheme)
	cfg.OpenAPIConfig = genericapiserver.DefaultOpenAPIConfig(generatedopenapi.GetOpenAPIDefinitions, namer)
	cfg.OpenAPIConfig.Info.Title, cfg.OpenAPIConfig.Info.Version = "Kubernetes", "v1.36.4"
	cfg.OpenAPIV3Config = genericapiserver.DefaultOpenAPIV3Config(generatedopenapi.GetOpenAPIDefinitions, namer)
	cfg.OpenAPIV3Config.Info.Title, cfg.OpenAPIV3Config.Info.Version = "Kubernetes", "v1.36.4"
	_ = openAPIDefs
	if err := ro.ApplyTo(cfg); err != nil {
		fail(err)
	}
	if *tokenFile != "" {
		ta, err := tokenfile.NewCSV(*tokenFile)
		if err != nil {
			fail(err)
		}
		cfg.Authentication.Authenticator = bearertoken.New(ta)
	}
	cfg.Authorization.Authorizer = authorizerfactory.NewAlwaysAllowAuthorizer()

	server, err := cfg.Complete().New("miniapiserver", genericapiserver.NewEmptyDelegate())
	if err != nil {
		fail(err)
	}

	groups := map[string]*genericapiserver.APIGroupInfo{}
	stores := map[string]*genericregistry.Store{}
	for _, k := range kinds {
		gi, ok := groups[k.gv.Group]
		if !ok {
			g := genericapiserver.NewDefaultAPIGroupInfo(k.gv.Group, scheme, logOptionsCodec{metav1.ParameterCodec}, codecs)
			gi = &g
			groups[k.gv.Group] = gi
		}
		if gi.VersionedResourcesStorageMap[k.gv.Version] == nil {
			gi.VersionedResourcesStorageMap[k.gv.Version] = map[string]rest.Storage{}
		}
		st := strategy{scheme, names.SimpleNameGenerator, k.namespaced, false}
		obj, list := k.obj, k.list
		gr := schema.GroupResource{Group: k.gv.Group, Resource: k.resource}
		attr := storage.DefaultNamespaceScopedAttr
		if !k.namespaced {
			attr = storage.DefaultClusterScopedAttr
		}
		store := &genericregistry.Store{
			NewFunc:                   func() runtime.Object { return obj.DeepCopyObject() },
			NewListFunc:               func() runtime.Object { return list.DeepCopyObject() },
			DefaultQualifiedResource:  gr,
			SingularQualifiedResource: schema.GroupResource{Group: k.gv.Group, Resource: k.singular},
			CreateStrategy:            st,
			UpdateStrategy:            st,
			DeleteStrategy:            st,
			TableConvertor:            rest.NewDefaultTableConvertor(gr),
		}
		if err := store.CompleteWithOptions(&generic.StoreOptions{RESTOptions: cfg.RESTOptionsGetter, AttrFunc: attr}); err != nil {
			fail(err)
		}
		gi.VersionedResourcesStorageMap[k.gv.Version][k.resource] = &shortNamed{store, k.short}
		stores[k.resource] = store
		if k.status {
			ss := *store
			ss.UpdateStrategy = strategy{scheme, names.SimpleNameGenerator, k.namespaced, true}
			ss.CreateStrategy, ss.DeleteStrategy = nil, nil
			gi.VersionedResourcesStorageMap[k.gv.Version][k.resource+"/status"] = &statusREST{&ss}
		}
	}
	groups[""].VersionedResourcesStorageMap["v1"]["pods/log"] = &logREST{stores["pods"], stores["nodes"]}
	if err := server.InstallLegacyAPIGroup("/api", groups[""]); err != nil {
		fail(err)
	}
	for g, gi := range groups {
		if g == "" {
			continue
		}
		if err := server.InstallAPIGroup(gi); err != nil {
			fail(err)
		}
	}

	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()
	if err := server.PrepareRun().RunWithContext(ctx); err != nil {
		fail(err)
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "miniapiserver:", err)
	os.Exit(1)
}
